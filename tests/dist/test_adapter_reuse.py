"""adapter.prompt=frozen with replay.reuse_steps=3 (`train --online`, 2 gloo ranks): the same prompts serve
3 steps, their states captured once and new branches sampled against them each step; a run resumed
after step 1 (its states gone, captured again) gives every later step bit-identically: reusing a
capture changes no number. Also: the trainer replays against the sampler's capture (the metrics
count the reused states), and reuse_steps > 1 without --online is refused."""

from __future__ import annotations

import json

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

ARGS = ["--config", "configs/demo-key-recall.yaml", "--online", "adapter.rank=4", "adapter.alpha=16",
        "adapter.prompt=frozen", "replay.reuse_steps=3", "replay.mode=detached", "train.groups_per_step=2",
        "rollout.group_size=4", "task.min_len=24", "task.max_len=40", "task.start_len=[]", "task.hold_steps=0",
        "task.ramp_steps=0", "task.eval_prompts=0", "train.lr=0.02", "device=cpu"]


def _metrics(path):
    return {m["step"]: m for m in (json.loads(x) for x in open(path)) if "loss" in m}


def test_reused_capture_equals_a_fresh_one(tmp_path):
    a = longstraw(2, "train", "--steps", "4", "--metrics-out", str(tmp_path / "a.jsonl"), *ARGS)
    assert a.returncode == 0, a.stderr[-3000:]
    b1 = longstraw(2, "train", "--steps", "1", "--save", str(tmp_path / "ck"), "--metrics-out",
                   str(tmp_path / "b.jsonl"), *ARGS)
    assert b1.returncode == 0, b1.stderr[-3000:]
    b2 = longstraw(2, "train", "--steps", "4", "--save", str(tmp_path / "ck"), "--resume", "--metrics-out",
                   str(tmp_path / "b.jsonl"), *ARGS)
    assert b2.returncode == 0, b2.stderr[-3000:]
    ma, mb = _metrics(tmp_path / "a.jsonl"), _metrics(tmp_path / "b.jsonl")
    print("reuse_steps=3: reused states per step", {s: ma[s]["reused_states"] for s in ma},
          "; resumed after step 1:", {s: mb[s]["reused_states"] for s in mb})
    assert [ma[s]["reused_states"] for s in (1, 2, 3, 4)] == [0, 2, 2, 0]   # step 4 starts a new block
    assert [mb[s]["reused_states"] for s in (2, 3)] == [0, 2]               # captured again after the resume
    keys = ("loss", "reward_mean", "grad_norm", "kl", "tokens", "prompt_tokens")
    for s in (1, 2, 3, 4):
        assert all(ma[s][k] == mb[s][k] for k in keys), (s, {k: (ma[s][k], mb[s][k]) for k in keys})
    assert ma[2]["grad_norm"] != ma[3]["grad_norm"]  # new branches each step: not a replayed step
    bad = longstraw(1, "train", "--steps", "2", "--rollouts", "nowhere.jsonl",
                    *[x for x in ARGS if x != "--online"])
    assert bad.returncode != 0 and "needs `train --online`" in bad.stderr, bad.stderr[-2000:]
