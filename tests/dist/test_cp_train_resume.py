"""`longstraw train` with context parallelism from one config plus overrides,
under torchrun (4 gloo ranks, DP=2 x CP=2, exact mode, gradients reduce-scattered into DP x CP shards
per micro-step and AdamW on the shards: train.grad_reduction=micro_step).

train: 4 steps with checkpoints at 2 and 4; then the step-4 checkpoint is removed (as if the run
had died after step 2's) and `--resume` must reproduce steps 3-4 exactly (every metric but wall time
and memory; the sharded AdamW state, its step count included, is part of what makes them equal).
(`validate` under CP: tests/dist/test_validate_full_path.py, numbers: tests/dist/test_context_parallel.py.)
A kill at every point of
a checkpoint's publication is covered by tests/dist/test_checkpoint_atomic.py."""

from __future__ import annotations

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from launch import longstraw as _torchrun  # noqa: E402


def test_train_dp2_cp2_resume(tmp_path):
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    rollouts = tmp_path / "r.jsonl"
    write_rollouts(rollouts, make_groups(512, 8, 30, 2, 6, seed=2, equal_reward_every=4))
    common = ["--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(rollouts), "parallel.cp=2",
              "replay.mode=exact", "replay.chunk_len=16", "train.lr=1e-3", "train.grad_reduction=micro_step",
              "train.save_every=2"]
    ckpt, full, resumed = tmp_path / "ckpt", tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    r = _torchrun(4, "train", *common, "--steps", "4", "--save", str(ckpt), "--metrics-out", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "layout tp=1 pp=1 cp=2 dp=2" in r.stdout
    shutil.rmtree(ckpt / "step_000004")
    (ckpt / "latest").write_text("step_000002")
    r = _torchrun(4, "train", *common, "--steps", "4", "--save", str(ckpt), "--resume", "--metrics-out", str(resumed))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 2" in r.stdout and "resharding" not in r.stdout
    a = [json.loads(x) for x in open(full)]
    b = [json.loads(x) for x in open(resumed)]
    assert [m["step"] for m in a] == list(range(1, 5)) and [m["step"] for m in b] == list(range(3, 5))
    volatile = {"seconds", "peak_bytes"}
    for x, y in zip(a[2:], b):
        assert {k: v for k, v in x.items() if k not in volatile} == {k: v for k, v in y.items() if k not in volatile}
    print(f"DP=2 x CP=2: steps 3-4 identical after resume; step 4 loss {b[-1]['loss']:.6f}")
