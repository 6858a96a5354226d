"""Resume at another layout (train/optimizer_state.py): a checkpoint written at DP=2 (2 gloo ranks, tp=1,
float32, one prompt group per rank per step) continues at TP=2 (dp=1) and at DP=1 (one rank), with two
groups per step there so every step trains on the same groups. Steps 3 and 4 after the resume have the
loss and gradient norm of the same layout's steps 3 and 4 within 1e-5 (the DP=2 run that wrote the step-2
checkpoint and went on to step 4: a same-layout resume equals it bit for bit, tests/dist/test_train_resume.py,
test_cp_train_resume.py, test_stop_and_lock.py, which also hold that a same-layout resume does not reshard):
step 3's are the loaded weights', step 4's come after an Adam update from the resharded moments (and, for
micro_step, master shards); the
groups carry reference log-probs and grpo.beta=0.1, so the loss depends on the weights (without an
optimizer state the step-4 gradient norm moves from 2.47 to 2.19).
Every optimizer: Megatron's (`step`), its distributed optimizer (state in ranges of its buffer per
data-parallel rank) and the per-micro-step shards (`micro_step`)."""

from __future__ import annotations

import json
import os
import sys

from launch import ROOT, longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())


def _metrics(path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_resume_at_tp2_and_dp1_continues_as_the_same_layout(tmp_path):
    import dataclasses

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    # reference log-probs and a KL term: the loss then depends on the weights (GRPO's ratio alone is 1
    # without old log-probs, whatever the weights)
    g = torch.Generator().manual_seed(3)
    groups = [dataclasses.replace(x, ref_logprobs=[(-6.0 + 0.5 * torch.randn(len(r), generator=g, dtype=torch.float64))
                                                   .tolist() for r in x.responses])
              for x in make_groups(512, 8, 50, 3, 6, seed=2)]
    write_rollouts(tmp_path / "r.jsonl", groups)
    common = ["--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(tmp_path / "r.jsonl"), "train.lr=1e-2",
              "train.save_every=2", "replay.mode=exact", "replay.chunk_len=16", "grpo.beta=0.1"]
    layouts = {"tp=2": (2, ["parallel.tp=2", "train.groups_per_step=2"]), "dp=1": (1, ["train.groups_per_step=2"])}
    optimizers = {"step": ["train.grad_reduction=step"], "micro_step": ["train.grad_reduction=micro_step"],
                  "distributed optimizer": ["train.grad_reduction=step", "train.distributed_optimizer=true"]}
    for red, which in optimizers.items():
        ck = tmp_path / red.replace(" ", "_")
        # the same layout (dp=2) from the start: checkpoints at steps 2 and 4; the resumes start from step 2's
        base_out = tmp_path / f"{ck.name}-same.jsonl"
        r = longstraw(2, "train", "--steps", "4", "--save", str(ck), "--metrics-out", str(base_out), *common, *which)
        assert r.returncode == 0, r.stderr[-3000:]
        base = _metrics(base_out)[2:]
        (ck / "step_000004").rename(tmp_path / f"{ck.name}-same-step4")
        (ck / "latest").write_text("step_000002")
        got = {}
        for name, (n, layout) in layouts.items():
            if red != "step" and name == "dp=1":
                continue
            out = tmp_path / f"{ck.name}-{n}-{len(layout)}.jsonl"
            r = longstraw(n, "train", "--steps", "4", "--save", str(ck), "--resume", "--metrics-out", str(out), *common,
                          *which, *layout)
            assert r.returncode == 0, (name, r.stderr[-3000:])
            assert "resharding" in r.stdout, r.stdout[-2000:]
            got[name] = _metrics(out)
            # the resumed run's checkpoint (step 4) is written at its own layout: the next resume starts again
            (ck / "step_000004").rename(tmp_path / f"{ck.name}-{n}-{len(layout)}-step4")
            (ck / "latest").write_text("step_000002")
        for name, m in got.items():
            for a, b in zip(m, base):
                print(f"{red}, {name}, step {a['step']}: loss {a['loss']:.9f} vs {b['loss']:.9f}, grad norm "
                      f"{a['grad_norm']:.9f} vs {b['grad_norm']:.9f}")
                assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-5, (red, name, a, b)
                assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (red, name, a, b)
            assert [x["step"] for x in m] == [3, 4]

