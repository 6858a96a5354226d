"""launch/slurm.sbatch against a real Slurm: Debian's slurm-wlm 22.05 and munge, one node on loopback
(scripts/slurm_local.sh; scripts/env.sh --test installs them where it may), CPU ranks
(LONGSTRAW_PROCS_PER_NODE=2).

- `sbatch launch/slurm.sbatch validate ...` on 2 ranks: the job completes (exit 0:0), the receipt is
  written, each rank's log is under logs/node0/rank<R>.log and its console lines carry its global rank.
- a bad input: the job's exit code is the project's 2 (not torchrun's 1), with one error line.
- `train` with --save, `scancel --signal=USR1` after step 3: the ranks stop with a checkpoint and exit 75,
  the script requeues the job, the requeued job (the same command line, no --resume) resumes from the
  checkpoint by itself and finishes; the output file keeps both runs (--open-mode=append), the metrics
  run 1..8 without a gap or a repeat. (Bit-exactness of a resume after a stop: test_stop_and_lock.py.)
Skipped, saying why, where Slurm is not installed or its daemons do not start."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): scripts/env.sh --test installs Debian's "
                    "slurm-wlm and munge where apt-get may run as root")
    d = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(["bash", str(ROOT / "scripts/slurm_local.sh"), "start", str(d)], capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"a one-node Slurm did not start here: {r.stderr.strip()[-500:]}")
    env = dict(os.environ, SLURM_CONF=r.stdout.strip().splitlines()[-1], LONGSTRAW_PROCS_PER_NODE="2",
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    yield env, d
    subprocess.run(["bash", str(ROOT / "scripts/slurm_local.sh"), "stop", str(d)], capture_output=True, timeout=60)


def _sbatch(env, out: Path, *args: str, extra_env=None) -> str:
    r = subprocess.run(["sbatch", "--parsable", "--nodes", "1", f"--output={out}", str(ROOT / "launch/slurm.sbatch"),
                        *args], cwd=ROOT, env=dict(env, **(extra_env or {})), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _job(env, jid: str) -> dict:
    r = subprocess.run(["scontrol", "show", "job", jid], env=env, capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S+)", r.stdout))


def _wait_done(env, jid: str, timeout: float = 600) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        j = _job(env, jid)
        if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return j
        time.sleep(1)
    raise AssertionError(f"job {jid} not done within {timeout} s: {_job(env, jid)}")


def test_slurm_validate_bad_input_and_a_train_stopped_requeued_and_resumed(slurm, tmp_path):
    env, _ = slurm
    py = sys.executable
    subprocess.run([py, "tools/make_hf_model.py", str(tmp_path / "hf"), "--config", "configs/qwen3.6-tiny.yaml"],
                   cwd=ROOT, check=True, capture_output=True)
    subprocess.run([py, "tools/make_rollouts.py", str(tmp_path / "r.jsonl"), "--vocab", "512", "--groups", "8",
                    "--prompt-len", "60", "--group-size", "3", "--response-len", "8"],
                   cwd=ROOT, check=True, capture_output=True)
    logs = tmp_path / "run"
    jid = _sbatch(env, tmp_path / "v.out", "validate", "--hf", str(tmp_path / "hf"), "--rollouts",
                  str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "v"), "device=cpu",
                  extra_env={"RUN_DIR": str(logs)})
    bad = _sbatch(env, tmp_path / "bad.out", "smoke", "--config", "configs/qwen3.6-tiny.yaml", "model.bogus=1")
    j = _wait_done(env, jid)
    text = (tmp_path / "v.out").read_text()
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0", (j, text[-2000:])
    assert (tmp_path / "v" / "receipt.json").is_file() and "[rank 0] [validate] loss" in text, text[-2000:]
    assert sorted(p.name for p in (logs / "logs" / "node0").iterdir()) == ["rank0.log", "rank1.log"]
    j = _wait_done(env, bad)
    text = (tmp_path / "bad.out").read_text()
    errors = [ln for ln in text.splitlines() if "error:" in ln and "srun:" not in ln]
    print(f"bad input job: {j['JobState']} exit {j['ExitCode']}; {errors}")
    assert j["ExitCode"] == "2:0" and len(errors) == 1 and "model.bogus" in errors[0], (j, text[-2000:])

    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    jid = _sbatch(env, tmp_path / "t.out", "train", "--config", "configs/qwen3.6-tiny.yaml", "--rollouts",
                  str(tmp_path / "r.jsonl"), "--steps", "8", "--save", str(ck), "--metrics-out", str(metrics),
                  "train.lr=1e-3", "device=cpu")
    t0 = time.monotonic()
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 3:
        assert time.monotonic() - t0 < 300 and _job(env, jid).get("JobState") in ("PENDING", "RUNNING")
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR1", jid], env=env, check=True)
    j = _wait_done(env, jid)  # (a requeued job waits cred_expire, 10 s here: scripts/slurm_local.sh)
    text = (tmp_path / "t.out").read_text()
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    print(f"train job: {j['JobState']} exit {j['ExitCode']} after {j['Restarts']} restart(s); steps logged {steps}")
    assert j["JobState"] == "COMPLETED" and j["ExitCode"] == "0:0" and j["Restarts"] == "1", (j, text[-3000:])
    assert "stopped by SIGUSR1" in text and "requeueing job" in text and "a requeue, resuming" in text, text[-3000:]
    assert "(restart 0)" in text and "(restart 1)" in text  # one output file for both runs
    assert steps == list(range(1, 9)), steps
