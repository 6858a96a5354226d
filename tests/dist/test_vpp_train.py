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
  directory, their optimizer state per rank) reproduces its steps 3 and 4;
- `longstraw validate` of the trained adapter on two rollout groups (a prompt of 40, G=3 of 1 to 6 tokens),
  PP=2 x VPP=2 against one rank: loss, per-token log-probs, gradient norm and every adapter gradient
  (--dump-grads, PEFT names) within 1e-12; the receipt counts each layer's forward calls on the rank that
  holds its chunk;
- `longstraw smoke`, 4 micro-batches a step (the interleaved schedule's fewest at PP=2 x VPP=2), against
  one rank: the same loss and gradient norm (float64).
"""

from __future__ import annotations

import json
import os
import sys

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

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
    _validate_and_smoke(tmp_path, vpp)


def _validate_and_smoke(tmp, vpp):
    from concurrent.futures import ThreadPoolExecutor

    from make_rollouts import make_groups
    from safetensors.torch import load_file

    from longstraw_mcore.data.rollouts import write_rollouts

    write_rollouts(tmp / "r.jsonl", make_groups(32, 2, 40, 3, 6, seed=3))
    common = ["--config", "configs/demo-key-recall.yaml", "--hf", str(tmp / "hf"), "model.dtype=float64"]
    val = ["validate", *common, "--adapter", str(tmp / "vpp" / "step_000004" / "adapter"), "--rollouts",
           str(tmp / "r.jsonl"), "--dump-grads", "replay.mode=exact", "replay.chunk_len=16"]
    smoke = ["smoke", *common, "--steps", "1", "--batch", "2", "--seq-len", "12", "--micro-batches", "4"]
    runs = [(1, *val, "--out", str(tmp / "val1")), (2, *val, "--out", str(tmp / "val2"), *vpp),
            (1, *smoke, "--metrics-out", str(tmp / "s1.jsonl")), (2, *smoke, "--metrics-out", str(tmp / "s2.jsonl"),
                                                                  *vpp)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda a: longstraw(a[0], *a[1:], timeout=600), runs))
    for r in done:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    one, inter = (json.loads((tmp / d / "receipt.json").read_text()) for d in ("val1", "val2"))
    assert inter["layout"]["pp"] == 2 and _close(one["loss"], inter["loss"]) and one["loss"] != 0, (one, inter)
    assert _close(one["grad_norm"], inter["grad_norm"]) and one["grad_norm"] > 0
    lp = [(x, y) for a, b in zip(one["logprobs"], inter["logprobs"]) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    assert len(lp) > 0 and all(_close(x, y) for x, y in lp)
    ga, gb = (load_file(str(tmp / d / "grads.safetensors")) for d in ("val1", "val2"))
    assert set(ga) == set(gb) and any("lora_A" in k for k in ga)
    worst = max(float((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp_min(1e-30)) for k in ga)
    assert worst <= 1e-12, worst
    # rank r holds virtual stages r and 2 + r: layers 0-1 and 4-5 on rank 0, 2-3 and 6-7 on rank 1
    assert [e["ranks_touched"] for e in inter["layers"]] == [[0], [0], [1], [1], [0], [0], [1], [1]], inter["layers"]
    a, b = (json.loads((tmp / f).read_text()) for f in ("s1.jsonl", "s2.jsonl"))
    assert a["micro_batches"] == b["micro_batches"] == 4, (a, b)
    assert _close(a["loss"], b["loss"]) and _close(a["grad_norm"], b["grad_norm"]) and a["grad_norm"] > 0, (a, b)
