"""Resume at another layout (train/optimizer_state.py): a checkpoint written at DP=2 (2 gloo ranks, tp=1,
float32, one prompt group per rank per step) continues at TP=2 (dp=1) and at DP=1 (one rank), with two
groups per step there so every step trains on the same groups. Steps 3 and 4 after the resume have the
loss and gradient norm of the same-layout resume within 1e-5: step 3's loss is the loaded weights',
step 4's is after an Adam update from the resharded moments (and, for micro_step, master shards).
Both gradient reductions: Megatron's optimizer (`step`) and the per-micro-step shards (`micro_step`).
A checkpoint whose optimizer state is per rank (Megatron's distributed optimizer) is refused at another
layout with exit 2 and one line saying why."""

from __future__ import annotations

import json
import subprocess
import sys

from launch import ROOT, longstraw


def _metrics(path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_resume_at_tp2_and_dp1_continues_as_the_same_layout(tmp_path):
    subprocess.run([sys.executable, "tools/make_rollouts.py", str(tmp_path / "r.jsonl"), "--vocab", "512", "--groups",
                    "8", "--prompt-len", "50", "--group-size", "3", "--response-len", "6"],
                   cwd=ROOT, check=True, capture_output=True)
    common = ["--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(tmp_path / "r.jsonl"), "train.lr=1e-2",
              "train.save_every=2", "replay.mode=exact", "replay.chunk_len=16"]
    layouts = {"same layout (dp=2)": (2, []), "tp=2": (2, ["parallel.tp=2", "train.groups_per_step=2"]),
               "dp=1": (1, ["train.groups_per_step=2"])}
    for red in ("step", "micro_step"):
        ck = tmp_path / red
        r = longstraw(2, "train", "--steps", "2", "--save", str(ck), *common, f"train.grad_reduction={red}")
        assert r.returncode == 0, r.stderr[-3000:]
        got = {}
        for name, (n, layout) in layouts.items():
            if red == "micro_step" and name == "dp=1":
                continue
            out = tmp_path / f"{red}-{n}-{len(layout)}.jsonl"
            r = longstraw(n, "train", "--steps", "4", "--save", str(ck), "--resume", "--metrics-out", str(out), *common,
                          f"train.grad_reduction={red}", *layout)
            assert r.returncode == 0, (name, r.stderr[-3000:])
            assert ("resharding" in r.stdout) == (name != "same layout (dp=2)"), r.stdout[-2000:]
            got[name] = _metrics(out)
            # the resumed run's checkpoint (step 4) is written at its own layout: the next resume starts again
            (ck / "step_000004").rename(tmp_path / f"{red}-{n}-{len(layout)}-step4")
            (ck / "latest").write_text("step_000002")
        base = got.pop("same layout (dp=2)")
        for name, m in got.items():
            for a, b in zip(m, base):
                print(f"{red}, {name}, step {a['step']}: loss {a['loss']:.9f} vs {b['loss']:.9f}, grad norm "
                      f"{a['grad_norm']:.9f} vs {b['grad_norm']:.9f}")
                assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-5, (red, name, a, b)
                assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (red, name, a, b)
            assert [x["step"] for x in m] == [3, 4]

    ck = tmp_path / "dist-opt"
    r = longstraw(2, "train", "--steps", "2", "--save", str(ck), *common, "train.distributed_optimizer=true")
    assert r.returncode == 0, r.stderr[-3000:]
    r = longstraw(1, "train", "--steps", "4", "--save", str(ck), "--resume", *common, "train.distributed_optimizer=true",
                  "train.groups_per_step=2")
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "distributed_optimizer" in errors[0], r.stderr[-2000:]
