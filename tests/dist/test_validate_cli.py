"""`longstraw validate` under torchrun (TP=2, exact mode, float64, weights from an HF directory):
receipt.json carries loss, per-token log-probs, grad norm, mode, layout, peak bytes and phase
seconds; grads.safetensors holds full tensors under the Hugging Face names, and they equal the
gradient of the same objective computed in process by plain full-sequence autograd at TP=1.
The same run under `mpirun -np 2` (launch/mpirun.sh, the mpi4py bootstrap) gives the same numbers."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from longstraw_mcore.launch_local import run_ranks
from launch import longstraw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _reference_worker(rank, world_size, hf_dir, rollouts):
    from longstraw_mcore.checkpoint.convert import load_hf_into_model
    from longstraw_mcore.checkpoint.full_state import gather_full
    from longstraw_mcore.checkpoint.qwen3_5 import read_config
    from longstraw_mcore.checkpoint.qwen3_5 import mcore_to_hf
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, RunConfig
    from longstraw_mcore.data.rollouts import load_rollouts
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.reference import full_sequence_branches

    m, _ = read_config(hf_dir)
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m, par, "cpu")
    load_hf_into_model(get_family(m.family), model, hf_dir, expect=m)
    groups = load_rollouts(rollouts, m.vocab_size)
    gcfg = GRPOConfig()
    logps, losses = [], []
    for g in groups:
        fn = group_loss_fn(g, gcfg, advantages(g.rewards, gcfg))

        def scaled(b, lp, fn=fn):
            loss, st = fn(b, lp)
            losses.append(float(loss))
            return loss / len(groups), st

        logps.append([lp.tolist() for lp in full_sequence_branches(model, g.prompt, g.responses, scaled)])
    return sum(losses) / len(groups), logps, mcore_to_hf(gather_full(model, grads=True), m)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny float64 HF checkpoint, three groups of rollouts and the full-sequence reference."""
    from hf_reference import build_hf_model, tiny_model_config
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    tmp = tmp_path_factory.mktemp("validate")
    m = tiny_model_config()
    hf_dir, rollouts = tmp / "hf", tmp / "r.jsonl"
    build_hf_model(m, seed=9).save_pretrained(hf_dir)
    write_rollouts(rollouts, make_groups(m.vocab_size, 3, 26, 3, 6, seed=4))
    ref = run_ranks(_reference_worker, 1, str(hf_dir), str(rollouts), timeout_s=300)[0]
    return tmp, hf_dir, rollouts, ref


def _args(hf_dir, rollouts, out):
    return ("validate", "--hf", str(hf_dir), "--rollouts", str(rollouts), "--out", str(out), "--mode", "exact",
            "--dump-grads", "parallel.tp=2", "device=cpu", "replay.chunk_len=7")


def _check_against_reference(out, ref, launcher):
    from safetensors.torch import load_file

    receipt = json.loads((out / "receipt.json").read_text())
    for key in ("loss", "logprobs", "grad_norm", "mode", "layout", "peak_bytes_per_rank", "seconds"):
        assert key in receipt, key
    assert receipt["mode"] == "exact" and receipt["layout"]["tp"] == 2 and len(receipt["peak_bytes_per_rank"]) == 2
    assert {"capture", "replay", "prompt_backward", "total"} <= set(receipt["seconds"])
    dumped = load_file(str(out / "grads.safetensors"))
    ref_loss, ref_logps, ref_grads = ref
    assert set(dumped) == set(ref_grads)
    worst = max(float((dumped[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()) for k in ref_grads)
    lp = max(abs(a - b) for g1, g2 in zip(receipt["logprobs"], ref_logps) for b1, b2 in zip(g1, g2)
             for a, b in zip(b1, b2))
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    print(f"validate (TP=2, exact, {launcher}) vs in-process full-sequence: worst grad rel {worst:.1e}, logp abs "
          f"{lp:.1e}, loss {receipt['loss']:.6g} vs {ref_loss:.6g}, grad norm {receipt['grad_norm']:.6g} vs {norm:.6g}")
    assert worst <= 1e-10 and lp <= 1e-10
    assert abs(receipt["loss"] - ref_loss) <= 1e-10 * abs(ref_loss)
    assert abs(receipt["grad_norm"] - norm) <= 1e-10 * norm


def test_validate_receipt_and_grads(case):
    tmp, hf_dir, rollouts, ref = case
    r = longstraw(2, *_args(hf_dir, rollouts, tmp / "torchrun"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_against_reference(tmp / "torchrun", ref, "torchrun")


def test_mpirun_bootstrap_validate(case):
    """`bash launch/mpirun.sh 2 validate ...`: ranks, world size, local rank and rendezvous from MPI
    (longstraw_mcore/launch_mpi.py), then the same entry point and the same numbers."""
    import shutil
    import subprocess

    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found: scripts/env.sh --test installs openmpi-bin where it can (root + apt-get)")
    pytest.importorskip("mpi4py")
    tmp, hf_dir, rollouts, ref = case
    env = dict(os.environ, PYTHON=sys.executable, MPIRUN_ARGS="--oversubscribe")
    r = subprocess.run(["bash", "launch/mpirun.sh", "2", *_args(hf_dir, rollouts, tmp / "mpirun")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "[mpi] 2 rank(s), 2 per host, rendezvous 127.0.0.1:" in r.stderr
    _check_against_reference(tmp / "mpirun", ref, "mpirun")
