"""`longstraw train --online` on interleaved pipeline stages equals one rank, and resumes exactly.

The key-recall demo's model (configs/demo-key-recall.yaml) from one Hugging Face directory in float64, LoRA
r=4 on every target, exact mode, gradients reduced per micro-step (train.grad_reduction=micro_step: float64
training), two prompt groups per step of G=4 on-policy responses (sampled from the weights being trained,
one forward-only micro-batch per token through the model chunks; 4 tokens each, short held-out prompts), 4
steps:
- PP=2 x VPP=2 (2 ranks; rank r holds virtual stages r and 2 + r, models/chunks.py) against one rank:
  every step's loss, gradient norm and held-out reward within 1e-12 (relative), the same rewards and
  token counts (any token sampled differently would change them: float64);
- the PP=2 x VPP=2 run resumed from its step-2 checkpoint (the chunks' adapters written as one PEFT
  directory, their optimizer state per rank) reproduces its steps 3 and 4.
"""

from __future__ import annotations

import json
import os
import sys

from launch import longstraw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

KEYS = ("loss", "grad_norm", "reward_mean", "tokens", "trained_tokens", "update_ok")


def _run(tmp, n, name, *extra):
    args = ["train", "--config", "configs/demo-key-recall.yaml", "--hf", str(tmp / "hf"), "--online",
            "--metrics-out", str(tmp / f"{name}.jsonl"), "--save", str(tmp / name), "model.dtype=float64",
            "train.grad_reduction=micro_step", "train.groups_per_step=2", "rollout.group_size=4",
            "rollout.max_tokens=4", "replay.chunk_len=16", "task.min_len=32", "task.max_len=48", "replay.mode=exact",
            "train.save_every=2",
            "adapter.rank=4", "task.eval_every=2", "task.eval_prompts=4", *extra]
    r = longstraw(n, *args, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [json.loads(x) for x in open(tmp / f"{name}.jsonl")]


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1e-30) or abs(a - b) <= 1e-15
    return a == b


def test_online_train_pp2_vpp2_equals_one_rank_and_resumes(tmp_path):
    import subprocess

    # (a subprocess: in this process the tool would open a process group whose port later launches inherit)
    r = subprocess.run([sys.executable, "tools/make_hf_model.py", str(tmp_path / "hf"), "--config",
                        "configs/demo-key-recall.yaml", "model.dtype=float64"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from concurrent.futures import ThreadPoolExecutor

    vpp = ("parallel.pp=2", "parallel.vpp=2")
    with ThreadPoolExecutor(2) as pool:  # (independent runs side by side)
        one, inter = pool.map(lambda a: _run(tmp_path, *a), [(1, "one", "--steps", "4"),
                                                               (2, "vpp", "--steps", "4", *vpp)])
    steps = [m for m in one if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and sum(m["update_ok"] for m in steps) >= 1, steps
    for a, b in zip(steps, [m for m in inter if "loss" in m]):
        for k in KEYS:
            assert _close(a[k], b[k]), (a["step"], k, a[k], b[k])
    held = [(a["heldout_reward"], b["heldout_reward"]) for a, b in zip(one, inter) if "heldout_reward" in a]
    assert len(held) >= 2 and all(_close(x, y) for x, y in held), held
    (tmp_path / "resumed.jsonl").write_text("")
    import shutil

    shutil.copytree(tmp_path / "vpp", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "step_000004")
    (tmp_path / "resumed" / "latest").write_text("step_000002")
    again = [m for m in _run(tmp_path, 2, "resumed", "--steps", "4", "--resume", *vpp) if "loss" in m]
    assert [m["step"] for m in again] == [3, 4], again
    for a, b in zip(again, [m for m in inter if "loss" in m][2:]):
        for k in KEYS:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
