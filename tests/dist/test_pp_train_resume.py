"""`longstraw train` at PP=2 under torchrun (2 gloo ranks, an uneven split of 3 + 5 layers, exact mode, Megatron DDP + Megatron's
optimizer in float32): 6 steps with checkpoints at 3 and 6; the step-6 checkpoint is removed (as if
the run had died after step 3's) and `--resume` must reproduce steps 4-6 exactly (every metric but
wall time and memory). Then `longstraw validate` of the step-6 checkpoint at PP=2 (an even split:
checkpoints are layout-free) and at one rank: loss, log-probs and every dumped gradient agree to float32
rounding. A kill at every point of a checkpoint's publication is covered by
tests/dist/test_checkpoint_atomic.py; float64 equality of every PP layout with one rank by
tests/dist/test_pipeline.py."""

from __future__ import annotations

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from launch import longstraw as _torchrun  # noqa: E402


def test_train_pp2_resume_and_validate_pp2_equals_one_rank(tmp_path):
    from compare_validate import compare
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    rollouts = tmp_path / "r.jsonl"
    write_rollouts(rollouts, make_groups(512, 6, 30, 3, 6, seed=3, equal_reward_every=4))
    common = ["--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(rollouts)]
    over = ["parallel.pp=2", "parallel.pp_layers=[3,5]", "replay.mode=exact", "replay.chunk_len=16", "train.lr=1e-3", "train.save_every=3"]
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    r = _torchrun(2, "train", *common, "--steps", "6", "--save", str(ckpt), "--metrics-out", str(full), *over)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "layout tp=1 pp=2 cp=1 dp=1" in r.stdout
    shutil.rmtree(ckpt / "step_000006")
    (ckpt / "latest").write_text("step_000003")
    r = _torchrun(2, "train", *common, "--steps", "6", "--save", str(ckpt), "--resume", "--metrics-out", str(resumed),
                  *over)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 3" in r.stdout
    a = [json.loads(x) for x in open(full)]
    b = [json.loads(x) for x in open(resumed)]
    assert [m["step"] for m in a] == list(range(1, 7)) and [m["step"] for m in b] == list(range(4, 7))
    volatile = {"seconds", "peak_bytes"}
    for x, y in zip(a[3:], b):
        assert {k: v for k, v in x.items() if k not in volatile} == {k: v for k, v in y.items() if k not in volatile}
    assert all(m["update_ok"] for m in a if m["skipped_groups"] == 0)
    print(f"PP=2: steps 4-6 identical after resume; step 6 loss {b[-1]['loss']:.6f}, grad norm {b[-1]['grad_norm']:.4f}")

    outs = {}
    for n, pp in ((2, 2), (1, 1)):
        outs[pp] = tmp_path / f"val_pp{pp}"
        r = _torchrun(n, "validate", *common, "--load", str(ckpt / "step_000006"), "--out", str(outs[pp]), "--mode",
                      "exact", "--dump-grads", f"parallel.pp={pp}", "replay.chunk_len=16")
        assert r.returncode == 0, r.stderr[-3000:]
    receipt = json.loads((outs[2] / "receipt.json").read_text())
    assert receipt["layout"]["pp"] == 2 and receipt["mode"] == "exact"
    diff = compare(outs[2], outs[1])
    print(f"validate PP=2 vs one rank (float32): {diff}")
    assert diff["loss"] <= 1e-5 and diff["logprob_abs"] <= 1e-5 and diff["grad_norm"] <= 1e-5, diff
    assert diff["grad_worst"] <= 1e-4, diff
