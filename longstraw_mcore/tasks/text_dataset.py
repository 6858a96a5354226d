"""A prompt dataset in text or chat form (`--dataset FILE`), tokenized once with the model's tokenizer.

    {"prompt": "text ...", "answer": "...", ...}                      a prompt as text
    {"messages": [{"role": "user", "content": "..."}, ...], ...}      a chat, rendered with the tokenizer's
                                                                      chat template (generation prompt added)

Any other field is the row's metadata: the whole row goes to the reward functions and environments.
Every row is read, checked and tokenized when the run starts, before any model work: a row without a
prompt, a chat row for a tokenizer without a chat template, a prompt longer than the limit (with
dataset.overlong=refuse) or a token id beyond the model's vocabulary is refused naming the file, the
line and the value (ConfigError: exit 2).

Order: epoch e visits the rows in a permutation keyed by (dataset.seed, e) (the file's order with
dataset.shuffle=false). A run draws rows by a global position (rows drawn so far, over every
data-parallel rank): position p is row `order(p // n)[p % n]`. The position is part of the checkpoint
(rollout/online.py), so a resumed run continues with the next rows, at any data-parallel size.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from longstraw_mcore.config import ConfigError
from longstraw_mcore.config.user_task import DatasetConfig


def load_tokenizer(path: str, what: str):
    """transformers.AutoTokenizer from a Hugging Face directory (nothing fetched from a hub)."""
    if not Path(path, "tokenizer_config.json").is_file() and not Path(path, "tokenizer.json").is_file():
        raise ConfigError(f"{what} {path!r}: no tokenizer there (tokenizer.json / tokenizer_config.json); give the "
                          "model's tokenizer with --tokenizer DIR")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (any failure to read it is the user's input)
        raise ConfigError(f"{what} {path!r}: cannot load the tokenizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})") from None


def eos_ids(tokenizer) -> list[int]:
    """The tokenizer's end-of-sequence ids (the default stop ids with --dataset); [] when it has none."""
    ids = tokenizer.eos_token_id
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    return sorted({int(i) for i in ids})


@dataclass
class TextDataset:
    path: str
    rows: list[dict]
    ids: list[list[int]]
    lines: list[int]          # the file line of each row (1-based), for messages
    truncated: int            # prompts cut to their last max_prompt_tokens tokens
    sha256: str
    cfg: DatasetConfig

    @classmethod
    def load(cls, path: str, tokenizer, cfg: DatasetConfig, max_prompt_tokens: int, vocab_size: int,
             what: str = "--dataset") -> "TextDataset":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{what} {path!r}: no such file")
        raw = p.read_bytes()
        rows, lines = [], []
        for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{what} {path} line {n}: not JSON ({e})") from None
            rows.append(_check_row(row, f"{what} {path} line {n}", tokenizer))
            lines.append(n)
        if not rows:
            raise ConfigError(f"{what} {path}: no rows")
        limit = cfg.max_prompt_tokens or max_prompt_tokens
        ids, truncated = [], 0
        for row, n, toks in zip(rows, lines, _tokenize(rows, tokenizer)):
            where = f"{what} {path} line {n}"
            if len(toks) > limit:
                if cfg.overlong == "refuse":
                    raise ConfigError(f"{where}: prompt of {len(toks)} tokens exceeds the limit of {limit} "
                                      f"(dataset.max_prompt_tokens, else rollout.max_prompt_len); set "
                                      "dataset.overlong=truncate to keep its last tokens")
                toks, truncated = toks[-limit:], truncated + 1
            if len(toks) < 2:
                raise ConfigError(f"{where}: prompt of {len(toks)} token(s); a prompt needs at least 2")
            bad = [t for t in toks if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"{where}: token id {bad[0]} is beyond model.vocab_size={vocab_size}: the "
                                  "tokenizer does not belong to this model")
            ids.append(toks)
        return cls(str(p), rows, ids, lines, truncated, hashlib.sha256(raw).hexdigest(), cfg)

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> list[int]:
        out = list(range(len(self.rows)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(out)
        return out

    def at(self, position: int) -> int:
        """The row drawn at global `position`."""
        epoch, k = divmod(position, len(self.rows))
        if getattr(self, "_epoch", None) != epoch:
            self._epoch, self._order = epoch, self.order(epoch)
        return self._order[k]


def _check_row(row, where: str, tokenizer) -> dict:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row is a JSON object, got {type(row).__name__}")
    if isinstance(row.get("prompt"), str):
        return row
    msgs = row.get("messages")
    if msgs is None:
        raise ConfigError(f"{where}: a row needs \"prompt\" (text) or \"messages\" (a chat: a list of "
                          f"{{\"role\", \"content\"}}); it has {sorted(row)}")
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in msgs)):
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: a chat row (\"messages\"), but the tokenizer has no chat template; give a "
                          "tokenizer with one (--tokenizer DIR) or write the prompt as text (\"prompt\")")
    return row


def _tokenize(rows: list[dict], tokenizer) -> list[list[int]]:
    """Token ids of each row's prompt: text as the tokenizer encodes it (its own special tokens added), a
    chat rendered by the template with the generation prompt, then encoded without adding any."""
    texts = [r["prompt"] if isinstance(r.get("prompt"), str) else None for r in rows]
    out = [None] * len(rows)
    plain = [i for i, t in enumerate(texts) if t is not None]
    if plain:
        for i, ids in zip(plain, tokenizer([texts[i] for i in plain])["input_ids"]):
            out[i] = list(ids)
    for i, r in enumerate(rows):
        if out[i] is None:
            text = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
            out[i] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out
