"""Small Hugging Face tokenizers built locally (nothing fetched), for the example tasks and for tests.

`word_tokenizer(words, out_dir)`: one token per whitespace-separated word, id i == words[i] exactly, so
a task defined on token ids (tasks/key_recall.py) can be written as text and read back to the same ids:
encode("w3 w0 w7") == [3, 0, 7] and decode joins the tokens with single spaces.

`train_bpe(texts, out_dir, vocab_size)`: byte-level BPE trained on `texts` (any text round-trips:
every byte has a token), digits split one per token (a digit is always the same single token,
whatever surrounds it), an end-of-text special token, an optional chat template.

Both write tokenizer.json (the `tokenizers` library's format) and tokenizer_config.json, a directory
`transformers.AutoTokenizer.from_pretrained` loads as its fast tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers


def word_tokenizer(words: list[str], out_dir, eos: str | None = None) -> Path:
    """A word-level tokenizer in `out_dir` with token id i == words[i]; `eos` (one of `words`) is its
    end-of-sequence token. A word missing from `words` fails to encode (no unknown token)."""
    if len(set(words)) != len(words):
        dup = sorted({w for w in words if words.count(w) > 1})
        raise ValueError(f"word_tokenizer: {len(words)} words with duplicates {dup[:8]}")
    bad = [w for w in words if not w or any(c.isspace() for c in w)]
    if bad:
        raise ValueError(f"word_tokenizer: words must be non-empty and hold no whitespace, got {bad[:8]!r}")
    if eos is not None and eos not in words:
        raise ValueError(f"word_tokenizer: eos={eos!r} is not one of the {len(words)} words")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no decoder: `tokenizers` then joins the tokens with single spaces, which is the decoding we want
    # (no library decoder does only that)
    if eos is not None:
        tok.add_special_tokens([AddedToken(eos, special=True)])  # keeps its id: it is in the vocabulary
    return _save(tok, out_dir, eos=eos, chat_template=None)


def train_bpe(texts: Iterable[str], out_dir, vocab_size: int, eos: str = "<|endoftext|>",
              chat_template: str | None = None) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` tokens (at most: the trainer stops when no pair
    repeats) trained on `texts`, written to `out_dir`. `eos` is a special token (id 0); `chat_template`
    (Jinja, as transformers' apply_chat_template reads it) is stored in tokenizer_config.json."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"train_bpe: vocab_size={vocab_size} is below the {len(alphabet)} byte tokens + eos")
    tok = Tokenizer(models.BPE())
    # digits first, each its own piece, so no merge can join a digit to anything; then GPT-2's byte-level
    # split (words, punctuation and spaces apart) and byte alphabet
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return _save(tok, out_dir, eos=eos, chat_template=chat_template)


def _save(tok: Tokenizer, out_dir, eos: str | None, chat_template: str | None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,  # decode must give the text back, spaces included
        "model_max_length": 1 << 30,
    }
    if eos is not None:
        config["eos_token"] = eos
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
