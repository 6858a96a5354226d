"""`longstraw validate` runs for the tests that hold a Triton path to its twin through the whole step under
Triton's interpreter (tests/dist/test_fla_validate.py, test_dsa_validate.py): the group they share (a
prompt and four responses, two pairs sharing their first tokens: prefix-tree segments), a run with or
without TRITON_INTERPRET=1, and the comparison of a run's receipt and gradients with the twin's."""

from __future__ import annotations

import json
import os
import sys

from launch import ROOT, longstraw

sys.path.insert(0, os.path.join(ROOT, "tools"))


def write_tree_group(path, vocab: int, prompt_len: int) -> None:
    """tools/make_rollouts.py's `tree_group` (a prompt, four responses sharing prefixes) written to `path`."""
    from make_rollouts import tree_group

    from longstraw_mcore.data.rollouts import write_rollouts

    write_rollouts(path, [tree_group(vocab, prompt_len)])


def validate(tmp, name: str, ranks: int, *overrides: str, interpret: bool, chunk_len: int):
    """`longstraw validate` (exact mode, gradients dumped, CPU) of tmp/hf on tmp/r.jsonl into tmp/name, under
    Triton's interpreter when `interpret`: (the output folder, its receipt)."""
    out = tmp / name
    r = longstraw(ranks, "validate", "--hf", str(tmp / "hf"), "--rollouts", str(tmp / "r.jsonl"), "--out", str(out),
                  "--mode", "exact", "--dump-grads", "device=cpu", f"replay.chunk_len={chunk_len}", *overrides,
                  timeout=600, env={"TRITON_INTERPRET": "1"} if interpret else None)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "receipt.json").read_text())


def check_equal(name: str, out, rec, twin, twin_rec, ops: tuple, kernel: str, tol: float) -> dict:
    """A run through the Triton path against the twin's: the receipt says the interpreter ran and every op
    in `ops` ran `kernel` only (never the twin); loss and log-probs within `tol` relative, every gradient
    within `tol` of its own largest entry. Returns the differences."""
    from compare_validate import compare

    assert rec["software"]["triton_interpreter"] is True
    for op in ops:
        assert set(rec["kernels"][op]) == {kernel} and rec["kernels"][op][kernel] > 0, (name, rec["kernels"])
    d = compare(out, twin)
    biggest = max(1.0, max(abs(x) for g in twin_rec["logprobs"] for b in g for x in b))
    assert d["loss"] <= tol and d["logprob_abs"] <= tol * biggest, (name, d)
    assert d["grad_worst"] <= tol, (name, d)
    return {k: d[k] for k in ("loss", "logprob_abs", "grad_worst", "grad_worst_name")}
