"""A long-context coding task: what does a function of a generated code base return?

    PYTHONPATH=. python examples/coding/make_dataset.py --out runs/coding_data \
        [--train 4000] [--heldout 64] [--min-modules 2] [--max-modules 11] [--ramp-rows 0] [--seed 0]

A row's prompt is a small Python package (a few modules, "# file: pkg/NAME.py" blocks; functions that
call functions of later modules through imports; identifiers from a small word list), then

    What does NAME('a') return?
    Answer:

The answer is one digit 1..8, and that digit is the only digit anywhere in the prompt: it sits in the
last function of the call chain NAME starts (`return 5`); every other function returns x, a string of
letters or another function's result. (The input is a letter, not a number: a digit in the question,
right before the answer, was a second digit for the model to copy, next to the answer's position;
with it the demo did not leave chance.) So this is key recall in code form: a
model that finds the one digit literal and copies it scores 1; a policy that ignores the prompt scores
1/8 in expectation (chance). Following the calls is what a model that reads code would do, and the
reward (examples/coding/reward.py) really runs the code, but the task does not need more than the copy.

Length: each row has min..max modules (uniform) of 1..3 functions each; with the defaults the
prompts are about 60 to 600 tokens of the tokenizer below. --ramp-rows R: the training rows' maximum
grows linearly from --min-modules to --max-modules over the first R rows, and the functions per module
from one to three over the first R / 2 (a length curriculum for the
dataset path with dataset.shuffle=false); held-out rows always use the full range.

Writes DIR/train.jsonl, DIR/heldout.jsonl, rows {"prompt": ..., "files": {path: source},
"function": "pkg.NAME.FUNC", "input": "a", "answer": "5"}, and DIR/tokenizer: byte-level BPE
(tasks/tokenizer_build.train_bpe, --vocab tokens, each digit one token, EOS "<|endoftext|>") trained on
generated rows (their own stream, not the training rows).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

MODULE_WORDS = ("alpha", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island", "jungle",
                "kettle", "lagoon", "meadow", "nectar", "orbit", "prairie", "quarry", "ridge", "summit", "tundra")
NAME_WORDS = ("red", "blue", "green", "cold", "warm", "fast", "slow", "tall", "apple", "river", "stone",
              "cloud", "tiger", "lemon", "queen", "robot", "paper", "honey", "wolf", "mint")
EOS = "<|endoftext|>"
MAX_FUNCS, MAX_DEPTH = 3, 3   # functions per module; functions in the answer's call chain
INPUT = "a"                   # the argument the question asks about (no digit)


def make_row(rng: random.Random, n_modules: int, max_funcs: int = MAX_FUNCS) -> dict:
    """One code base of `n_modules` modules of 1..max_funcs functions and its question (module docstring)."""
    mods = rng.sample(MODULE_WORDS, n_modules)
    counts = [rng.randint(1, max_funcs) for _ in mods]
    pairs = [f"{a}_{b}" for a in NAME_WORDS for b in NAME_WORDS if a != b]
    names = rng.sample(pairs, sum(counts))
    owner = [m for m, c in enumerate(counts) for _ in range(c)]  # function f lives in module owner[f]
    F = len(names)
    # a function calls only functions after it (modules in order): no recursion, no circular import
    chain = sorted(rng.sample(range(F), rng.randint(1, min(MAX_DEPTH, F))))
    answer = rng.randint(1, 8)
    body = {f: f"{names[g]}(x)" for f, g in zip(chain, chain[1:])}
    body[chain[-1]] = f"{answer}"
    for f in range(F):
        if f not in body:
            later = range(f + 1, F)
            kind = rng.choice(["x", "word", "call"] if later else ["x", "word"])
            body[f] = ("x" if kind == "x" else repr(rng.choice(NAME_WORDS)) if kind == "word"
                       else f"{names[rng.choice(later)]}(x)")
    files = {}
    for m, mod in enumerate(mods):
        imports: dict[str, list[str]] = {}
        for f in range(F):
            if owner[f] == m:
                for g in range(f + 1, F):
                    if owner[g] != m and f"{names[g]}(" in body[f]:
                        imports.setdefault(mods[owner[g]], []).append(names[g])
        head = "".join(f"from pkg.{src} import {', '.join(fs)}\n" for src, fs in imports.items())
        defs = "\n".join(f"def {names[f]}(x):\n    return {body[f]}\n" for f in range(F) if owner[f] == m)
        files[f"pkg/{mod}.py"] = head + ("\n" if head else "") + defs
    name = names[chain[0]]
    prompt = "".join(f"# file: {path}\n{src}\n" for path, src in files.items())
    prompt += f"What does {name}({INPUT!r}) return?\nAnswer: "
    digits = [c for c in prompt if c.isdigit()]
    assert digits == [str(answer)], digits   # the answer's digit, once
    return {"prompt": prompt, "files": files, "function": f"pkg.{mods[owner[chain[0]]]}.{name}", "input": INPUT,
            "answer": str(answer)}


def rows(rng: random.Random, n: int, lo: int, hi: int, ramp: int = 0):
    """Rows of lo..hi modules; over the first `ramp` rows the largest module count grows from lo, and the
    functions per module from 1 to MAX_FUNCS over the ramp's first half (the shortest rows: one function)."""
    for k in range(n):
        top = hi if k >= ramp else lo + (hi - lo) * k // ramp
        funcs = MAX_FUNCS if k >= ramp // 2 else 1 + (MAX_FUNCS - 1) * k // max(ramp // 2, 1)
        yield make_row(rng, rng.randint(lo, top), funcs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--train", type=int, default=4000, help="training rows")
    p.add_argument("--heldout", type=int, default=64, help="held-out rows")
    p.add_argument("--min-modules", type=int, default=2)
    p.add_argument("--max-modules", type=int, default=11)
    p.add_argument("--ramp-rows", type=int, default=0, help="length curriculum over the first training rows")
    p.add_argument("--vocab", type=int, default=448, help="tokenizer vocabulary (at most)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 1 <= a.min_modules <= a.max_modules <= len(MODULE_WORDS):
        p.error(f"need 1 <= --min-modules={a.min_modules} <= --max-modules={a.max_modules} <= {len(MODULE_WORDS)}")
    from longstraw_mcore.tasks.tokenizer_build import train_bpe

    a.out.mkdir(parents=True, exist_ok=True)
    for name, n, ramp in (("train", a.train, a.ramp_rows), ("heldout", a.heldout, 0)):
        with open(a.out / f"{name}.jsonl", "w") as f:
            for row in rows(random.Random(f"{a.seed}:{name}"), n, a.min_modules, a.max_modules, ramp):
                f.write(json.dumps(row) + "\n")
    corpus = (r["prompt"] + r["answer"] + EOS
              for r in rows(random.Random(f"{a.seed}:tokenizer"), 500, a.min_modules, a.max_modules))
    train_bpe(corpus, a.out / "tokenizer", a.vocab, eos=EOS)
    print(f"wrote {a.out}/train.jsonl ({a.train} rows), heldout.jsonl ({a.heldout} rows), tokenizer/")


if __name__ == "__main__":
    main()
