"""Coding reward (`--reward examples/coding/reward.py:reward`): runs the row's code and compares.

The row's files (examples/coding/make_dataset.py) are written to a temporary directory once per call;
a subprocess (`python -I -c`, a time limit of TIMEOUT_S) imports row["function"] from them and prints
FUNC(row["input"]); a response scores 1.0 when its first line, stripped (and cut at the tokenizer's EOS
text, should the decoded response keep it), equals that printed str(result), else 0.0. The code is run,
not looked up: row["answer"] is never read here (tests/unit/test_examples.py checks the two agree).
A failed or timed-out run raises: the trainer reports it (reward.on_failure) instead of scoring zeros.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath

TIMEOUT_S = 10.0
EOS = "<|endoftext|>"


def run_function(files: dict[str, str], function: str, arg) -> str:
    """str(FUNC(arg)) for "pkg.mod.FUNC" defined by `files` ({relative path: source}), run in a subprocess."""
    module, name = function.rsplit(".", 1)
    with tempfile.TemporaryDirectory() as root:
        for path, source in files.items():
            rel = PurePosixPath(path)
            if rel.is_absolute() or ".." in rel.parts:
                raise ValueError(f"file path {path!r} leaves the code base's directory")
            out = Path(root, *rel.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(source)
        code = f"import sys; sys.path.insert(0, {root!r}); from {module} import {name}; print({name}({arg!r}))"
        run = subprocess.run([sys.executable, "-I", "-c", code], cwd=root, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    if run.returncode != 0:
        raise RuntimeError(f"{function}({arg!r}) failed (exit {run.returncode}): {run.stderr.strip()[-800:]}")
    return run.stdout.strip()


def first_line(response: str) -> str:
    text = response.split(EOS, 1)[0].strip()
    return text.split("\n", 1)[0].strip()


def reward(responses: list[str], row: dict) -> list[float]:
    result = run_function(row["files"], row["function"], row["input"])
    return [float(first_line(r) == result) for r in responses]


def is_number(responses: list[str], row: dict) -> list[float]:
    """A shaping reward (`--reward examples/coding/reward.py:is_number`, weighted low: reward.weights=[1, 0.2]):
    1.0 for an answer that is an integer, whatever its value. A random-init model rarely writes a digit;
    this teaches the answer's form first, so the correct digit gets sampled and rewarded."""
    return [float(first_line(r).lstrip("-").isdigit()) for r in responses]
