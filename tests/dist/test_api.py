"""The Python API (longstraw_mcore/api.py) driven by a user's own loop (tests/own_task/driver.py: its own
prompts, sampling calls and reward) for two steps gives the same parameters as `longstraw train` on the
same groups (the rollouts file the driver wrote, in its order): the two checkpoints hold equal tensors,
bit for bit, since both run the same trainer on the same groups from the same seeded initialisation.
The weights `hf_weights()` hands out equal the Hugging Face export of the driver's checkpoint
(`mcore_to_hf_dir`, what `longstraw convert` writes), name for name and bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

from launch import ROOT, longstraw

OVER = ["train.groups_per_step=2", "rollout.group_size=4", "rollout.max_tokens=4", "train.lr=1e-3", "device=cpu"]


def _compare(rank, world_size, tmp):
    """In a process of its own with a process group (Megatron's checkpoint reader needs one)."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from longstraw_mcore.checkpoint.convert import mcore_to_hf_dir
    from longstraw_mcore.checkpoint.dist_ckpt import load_full_tensors
    from longstraw_mcore.families import get_family

    tmp = Path(tmp)
    api = load_full_tensors(tmp / "api_ckpt" / "step_000002")
    cli = load_full_tensors(tmp / "cli_ckpt" / "step_000002")
    mcore_to_hf_dir(get_family("qwen3_5"), tmp / "api_ckpt" / "step_000002", tmp / "hf", log=lambda *_: None)
    exported = {}
    for f in (tmp / "hf").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    handed = load_file(str(tmp / "weights.safetensors"))
    init = load_full_tensors(tmp / "cli_ckpt" / "step_000001")
    return {"keys": sorted(api) == sorted(cli), "n": len(api),
            "differ": [k for k in api if not torch.equal(api[k], cli[k])],
            "moved": sum(not torch.equal(api[k], init[k]) for k in api),
            "hf_keys": sorted(set(handed) ^ set(exported)),
            "hf_differ": [k for k in exported if k in handed and not torch.equal(handed[k], exported[k])]}


def test_api_driver_equals_cli(tmp_path):
    from longstraw_mcore.launch_local import run_ranks

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "tests/own_task/driver.py", str(tmp_path), *OVER], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    r = longstraw(1, "train", "--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(tmp_path / "groups.jsonl"),
                  "--steps", "2", "--save", str(tmp_path / "cli_ckpt"), "train.save_every=1", *OVER)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = run_ranks(_compare, 1, str(tmp_path), timeout_s=300)[0]
    print(f"{got['n']} tensors: {len(got['differ'])} differ between the API's and the CLI's step 2 "
          f"({got['moved']} moved by step 2); hf_weights vs the export: {len(got['hf_differ'])} differ")
    assert got["keys"] and got["n"] > 10 and not got["differ"], got["differ"][:5]
    assert got["moved"] > 10   # the second step changed the weights: the comparison is not of untouched ones
    assert not got["hf_keys"] and not got["hf_differ"], (got["hf_keys"][:5], got["hf_differ"][:5])
