"""The built-in tasks (tasks/key_recall.py, tasks/tool_lookup.py) written as a text dataset: one word per
token id, and the prompts in the order `train --online` draws them, so that the dataset path
(`--dataset train.jsonl`, dataset.shuffle=false) trains on the same token ids in the same order.

Words: token i is `words[i]`: "<unused>" (id 0), "M" (the marker), "v0" .. "v{n_values-1}" (the values),
"d0", "d1", ... (the distractors, up to the model's vocabulary); tokenizer_build.word_tokenizer over them
encodes a prompt's text back to its ids.

Order (rollout/online.py, OnlineGroups.groups): at step s, data-parallel rank r of `dp` draws its
`n = train.groups_per_step` prompts idx = (block * dp + r) * n + i, i < n, block = (s - 1) // K
(K = replay.reuse_steps: one block of prompts serves K steps) at the curriculum's lengths of the block's
first step, TaskConfig.lengths(block * K + 1). So the prompts are idx = 0, 1, 2, ... in the order the
dataset path reads rows ((s - 1) * dp * n + r * n + i with K = 1), row k at block k // (dp * n).
With K > 1 the rows are each block's prompts once. Held-out prompt j is example(-1 - j) at full lengths.

`write_cli` is the command line of examples/key_recall/make_dataset.py and examples/tool_lookup/make_dataset.py:
DIR/train.jsonl, DIR/heldout.jsonl and DIR/tokenizer (word_tokenizer over the words, no EOS).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from longstraw_mcore.config import RunConfig, load_config
from longstraw_mcore.rollout.online import OnlineGroups, make_task
from longstraw_mcore.tasks.tokenizer_build import word_tokenizer
from longstraw_mcore.tasks.vocabulary import TaskVocabulary


def task_words(task: TaskVocabulary) -> list[str]:
    """words[i] names token i of the task's vocabulary (see the module docstring)."""
    n_dist = task.vocab_size - task.first_distractor
    words = ["<unused>"] * task.vocab_size
    words[task.marker] = "M"
    for j, v in enumerate(task.values):
        words[v] = f"v{j}"
    for j in range(n_dist):
        words[task.first_distractor + j] = f"d{j}"
    assert task.marker == 1 and "<unused>" not in words[1:], words
    return words


def as_text(words: list[str], ids: list[int]) -> str:
    return " ".join(words[i] for i in ids)


def train_examples(cfg: RunConfig, dp: int, steps: int) -> Iterator[tuple[list[int], object]]:
    """(prompt ids, answer) of the training prompts of steps 1..steps on `dp` data-parallel ranks, in the
    order of the module docstring (answer: key recall's key ids, tool lookup's secret id)."""
    if dp < 1 or steps < 1:
        raise ValueError(f"dp={dp}, steps={steps}: both must be >= 1")
    online = OnlineGroups(cfg)
    K, n = cfg.replay.reuse_steps, cfg.train.groups_per_step
    for block in range(-(-steps // K)):
        lengths = cfg.task.lengths(block * K + 1)
        for rank in range(dp):
            for i in range(n):
                yield online.example((block * dp + rank) * n + i, lengths)


def heldout_examples(cfg: RunConfig, n: int) -> Iterator[tuple[list[int], object]]:
    """(prompt ids, answer) of held-out prompts 0..n-1 (OnlineGroups.held_out's, at full lengths)."""
    online = OnlineGroups(cfg)
    for j in range(n):
        yield online.example(-1 - j)


def write_cli(doc: str, task_name: str, row: Callable[[list[str], list[int], object], dict], argv=None) -> None:
    """`--config CFG --dp N --steps S --out DIR [--heldout H] [key=value ...]`: the task's rows
    row(words, prompt ids, answer) for the run of that config, dp and steps; `doc` is the script's help."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--dp", type=int, required=True, help="data-parallel ranks of the training run")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps of the training run")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--heldout", type=int, default=None, help="held-out rows (default: task.eval_prompts)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, as `longstraw train` takes them")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if cfg.task.name != task_name:
        p.error(f"{a.config}: task.name={cfg.task.name!r}, this script writes {task_name}")
    words = task_words(make_task(cfg))
    a.out.mkdir(parents=True, exist_ok=True)
    n_held = cfg.task.eval_prompts if a.heldout is None else a.heldout
    for name, examples in (("train", train_examples(cfg, a.dp, a.steps)), ("heldout", heldout_examples(cfg, n_held))):
        with open(a.out / f"{name}.jsonl", "w") as f:
            for prompt, answer in examples:
                f.write(json.dumps(row(words, prompt, answer)) + "\n")
    word_tokenizer(words, a.out / "tokenizer")
    print(f"wrote {a.out}/train.jsonl, heldout.jsonl ({n_held} rows), tokenizer/ ({len(words)} words)")
