"""`TRITON_INTERPRET=1 longstraw validate ... ops.gdn=fla` equals the twin's `validate` (float32, exact mode,
on the CPU): every Gated DeltaNet use through flash-linear-attention's Triton kernels, run by Triton's
interpreter (ops/triton_interpret.py), against `ops.gdn=plain` at one rank. The group exercises
  - capture: three prompt chunks, the recurrent state and conv window carried between them;
  - replay: the branches from the captured state (the receipt's log-probs);
  - exact mode's sweep: each chunk recomputed from its entering state, seeded with the gradient of the
    state it leaves, depositing into the one before (the initial- and final-state gradients of fla);
  - prefix-tree segments: two pairs of responses sharing their first tokens (replayed once, their GDN
    state a leaf the tails read);
  - context parallelism at CP=2, by head shards (`model.gdn_cp=heads`: the all-to-all exchange) and by
    sequence pieces (`model.gdn_cp=sequence`: the piece maps on values K wider and the scan).
Loss and log-probs within 1e-5 relative, every gradient within 1e-5 of its own largest entry (the HF
reference's weights keep the decay meaningful: A in [0.05, 1]), and the receipts' `kernels` say which
kernel ran (fla for gdn_rule and gdn_conv, never the twin, under ops.gdn=fla). Not covered: CUDA (the GPU
check), bf16 (fla's rounding differs by design), TP (the same per-rank calls on fewer heads)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from launch import longstraw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
TOL = 1e-5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    pytest.importorskip("fla", reason="fla-core (the test extra) holds the kernels under test")
    from hf_reference import build_hf_model, tiny_model_config

    from longstraw_mcore.data.rollouts import RolloutGroup, write_rollouts

    tmp = tmp_path_factory.mktemp("fla_validate")
    m = tiny_model_config(num_layers=2, full_attention_interval=2, linear_key_head_dim=16, linear_value_head_dim=16,
                          dtype="float32")
    build_hf_model(m, seed=5).save_pretrained(tmp / "hf")
    import random

    rng = random.Random(3)
    tok = lambda n: [rng.randrange(m.vocab_size) for _ in range(n)]  # noqa: E731
    shared_a, shared_b = tok(4), tok(3)
    responses = [shared_a + tok(5), shared_a + tok(3), shared_b + tok(6), tok(7)]
    write_rollouts(tmp / "r.jsonl", [RolloutGroup(prompt=tok(90), responses=responses, rewards=[0.1, 0.9, 0.4, 0.7])])
    return tmp


def _validate(tmp, name: str, ranks: int, *overrides: str, interpret: bool):
    out = tmp / name
    env = {"TRITON_INTERPRET": "1"} if interpret else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        r = longstraw(ranks, "validate", "--hf", str(tmp / "hf"), "--rollouts", str(tmp / "r.jsonl"), "--out", str(out),
                      "--mode", "exact", "--dump-grads", "device=cpu", "replay.chunk_len=32", *overrides, timeout=600)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "receipt.json").read_text())


def test_fla_validate_equals_the_twin(case):
    from compare_validate import compare

    twin, tr = _validate(case, "plain", 1, "ops.gdn=plain", interpret=False)
    assert tr["kernels"]["gdn_rule"] == {"plain": tr["kernels"]["gdn_rule"]["plain"]} and "fla" not in tr["kernels"]["gdn_conv"]
    assert tr["seconds"].get("prompt_backward", 0) > 0
    assert tr["replayed_tokens"] < tr["response_tokens"]  # the shared prefix ran once, as a segment
    runs = [("fla", 1, ()), ("fla_cp2_heads", 2, ("parallel.cp=2", "model.gdn_cp=heads")),
            ("fla_cp2_sequence", 2, ("parallel.cp=2", "model.gdn_cp=sequence"))]
    worst = {}
    for name, ranks, extra in runs:
        out, rec = _validate(case, name, ranks, "ops.gdn=fla", *extra, interpret=True)
        assert rec["software"]["triton_interpreter"] is True
        for op in ("gdn_rule", "gdn_conv"):
            assert set(rec["kernels"][op]) == {"fla"} and rec["kernels"][op]["fla"] > 0, (name, rec["kernels"])
        d = compare(out, twin)
        worst[name] = {k: d[k] for k in ("loss", "logprob_abs", "grad_worst", "grad_worst_name")}
        assert d["loss"] <= TOL and d["logprob_abs"] <= TOL * max(1.0, max(abs(x) for g in tr["logprobs"] for b in g
                                                                            for x in b)), (name, d)
        assert d["grad_worst"] <= TOL, (name, d)
    print("fla under the interpreter vs the twin:", worst)
