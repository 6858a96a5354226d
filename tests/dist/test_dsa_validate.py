"""`TRITON_INTERPRET=1 longstraw validate ... ops.dsa=triton` on a GLM model equals the twin's `validate`
(float32, exact mode, on the CPU): every DSA use through the project's Triton kernels (the indexer's
streaming top-k, sparse MLA forward and backward), run by Triton's interpreter, against `ops.dsa=plain`.
The model: GLM-5.2's tiny width (configs/glm-5.2-tiny.yaml) cut to 4 layers (three full indexer layers and
a shared one, top-k 8 of a 40-token prompt: the sparse regime), transformers-layout weights. The group
exercises capture in chunks of 16, the replay of the branches, exact mode's sweep (the latents' and RoPE
keys' gradients scatter-added into the prompt state's leaves) and prefix-tree segments (two pairs of
responses sharing their first tokens); at one rank and at CP=2 (the state sharded by sequence, the
kernels' per-rank proposals merged into the global top-k, their partial attention merged by
log-sum-exp). Loss and log-probs within 1e-5 relative, every gradient within 1e-5 of its own largest
entry, and the receipts' `kernels` say which kernel ran (triton for dsa_indexer and dsa_attention, never
the twin, under ops.dsa=triton). Not covered: CUDA (the GPU check), bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch import ROOT, longstraw

sys.path.insert(0, os.path.join(ROOT, "tools"))
TOL = 1e-5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    pytest.importorskip("triton", reason="Triton (the test extra) runs the kernels under its interpreter")
    import random

    from longstraw_mcore.data.rollouts import RolloutGroup, write_rollouts

    tmp = tmp_path_factory.mktemp("dsa_validate")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "tools/make_hf_model.py", str(tmp / "hf"), "--config", "configs/glm-5.2-tiny.yaml",
                        "--seed", "3", "model.num_layers=4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rng = random.Random(3)
    tok = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
    shared_a, shared_b = tok(4), tok(3)
    responses = [shared_a + tok(5), shared_a + tok(3), shared_b + tok(6), tok(7)]
    write_rollouts(tmp / "r.jsonl", [RolloutGroup(prompt=tok(40), responses=responses, rewards=[0.1, 0.9, 0.4, 0.7])])
    return tmp


def _validate(tmp, name: str, ranks: int, *overrides: str, interpret: bool):
    out = tmp / name
    env = {"TRITON_INTERPRET": "1"} if interpret else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        r = longstraw(ranks, "validate", "--hf", str(tmp / "hf"), "--rollouts", str(tmp / "r.jsonl"), "--out", str(out),
                      "--mode", "exact", "--dump-grads", "device=cpu", "replay.chunk_len=16", *overrides, timeout=600)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "receipt.json").read_text())


def test_dsa_kernels_validate_equals_the_twin(case):
    from compare_validate import compare

    twin, tr = _validate(case, "plain", 1, "ops.dsa=plain", interpret=False)
    assert set(tr["kernels"]["dsa_indexer"]) == {"plain"} and set(tr["kernels"]["dsa_attention"]) == {"plain"}
    assert tr["seconds"].get("prompt_backward", 0) > 0
    assert tr["replayed_tokens"] < tr["response_tokens"]  # the shared prefixes ran once, as segments
    worst = {}
    for name, ranks, extra in [("triton", 1, ()), ("triton_cp2", 2, ("parallel.cp=2",))]:
        out, rec = _validate(case, name, ranks, "ops.dsa=triton", *extra, interpret=True)
        assert rec["software"]["triton_interpreter"] is True
        for op in ("dsa_indexer", "dsa_attention"):
            assert set(rec["kernels"][op]) == {"triton"} and rec["kernels"][op]["triton"] > 0, (name, rec["kernels"])
        d = compare(out, twin)
        worst[name] = {k: d[k] for k in ("loss", "logprob_abs", "grad_worst", "grad_worst_name")}
        assert d["loss"] <= TOL and d["logprob_abs"] <= TOL * max(1.0, max(abs(x) for g in tr["logprobs"] for b in g
                                                                            for x in b)), (name, d)
        assert d["grad_worst"] <= TOL, (name, d)
    print("DSA kernels under the interpreter vs the twin:", worst)
