"""`longstraw train` on a signal and on a held --save directory, launched as a user launches it
(launch/local.sh: 2 gloo ranks, exact mode, float32, one prompt group per rank per step).

- SIGTERM to the launcher while step 4 runs, in a run that saves every 100 steps: the ranks stop at the
  next safe point, write a checkpoint of step 3 (step 4 abandoned) and exit 75 (train/stop.py), within
  60 s of the signal. Resumed, its steps 4 and 5 have the loss and gradient norm of an uninterrupted run
  bit for bit: the abandoned step is redone from the same weights, optimizer state and groups.
- While the resumed run holds the directory, a second run on it is refused with exit 2 and one line
  naming the directory and the holder (host, pid), before it builds a model; the checkpoint of step 3
  is untouched (same manifest, still verifies). A SIGUSR1 stops the resumed run too (exit 75).
- train.keep_last=2 with a checkpoint every step leaves the newest two.
- Non-finite steps (train.lr=1e30 blows the weights up after step 1): no update is made by them, they
  are counted (skipped_updates), and train.max_bad_steps=2 in a row stop the run with exit 3, one error
  line naming the step, and a checkpoint.
What it does not cover: Slurm's own signalling and requeue (tests/dist/test_multinode_slurm.py), the lock's
stale cases (tests/unit/test_run_dir.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _launch(n: int, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.Popen(["bash", str(ROOT / "launch/local.sh"), str(n), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_steps(path: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while len(_metrics(path)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, f"no step {n} within {timeout} s"
        time.sleep(0.2)


def test_sigterm_checkpoints_the_step_reached_resume_is_exact_and_a_held_directory_is_refused(tmp_path):
    subprocess.run([sys.executable, "tools/make_rollouts.py", str(tmp_path / "r.jsonl"), "--vocab", "512",
                    "--groups", "8", "--prompt-len", "120", "--group-size", "4", "--response-len", "12"],
                   cwd=ROOT, check=True, capture_output=True)
    common = ["--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(tmp_path / "r.jsonl"), "train.lr=1e-3",
              "replay.mode=exact", "replay.chunk_len=16", "train.save_every=100"]
    ck = tmp_path / "ck"

    a = _launch(2, "train", "--steps", "5", "--metrics-out", str(tmp_path / "a.jsonl"), "--save", str(tmp_path / "a"),
                *common, "train.save_every=1", "train.keep_last=2")
    out, err = a.communicate(timeout=600)
    assert a.returncode == 0, err[-3000:]
    uninterrupted = _metrics(tmp_path / "a.jsonl")
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*")) == ["step_000004", "step_000005"]  # keep_last

    b = _launch(2, "train", "--steps", "100", "--save", str(ck), "--metrics-out", str(tmp_path / "b.jsonl"), *common)
    _wait_steps(tmp_path / "b.jsonl", 3, b)
    b.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, err = b.communicate(timeout=120)
    took = time.monotonic() - t0
    print(f"SIGTERM after step 3: exit {b.returncode} in {took:.1f} s; steps logged {len(_metrics(tmp_path / 'b.jsonl'))}")
    assert b.returncode == 75 and took <= 60, (b.returncode, took, err[-3000:])
    steps = sorted(p.name for p in ck.glob("step_*"))
    assert steps == ["step_000003"] and len(_metrics(tmp_path / "b.jsonl")) == 3, (steps, out[-2000:])
    assert "stopped by SIGTERM during step 4" in out, out[-2000:]
    manifest = (ck / "step_000003" / "manifest.json").read_text()

    c = _launch(2, "train", "--steps", "100", "--save", str(ck), "--resume", "--metrics-out",
                str(tmp_path / "c.jsonl"), *common)
    _wait_steps(tmp_path / "c.jsonl", 2, c)
    t0 = time.monotonic()
    d = _launch(1, "train", "--steps", "100", "--save", str(ck), "--resume", *common)
    d_out, d_err = d.communicate(timeout=300)
    refused_in = time.monotonic() - t0
    c.send_signal(signal.SIGUSR1)
    c_out, c_err = c.communicate(timeout=120)
    errors = [ln for ln in d_err.splitlines() if ln.startswith("error:")]
    print(f"second run: exit {d.returncode} after {refused_in:.1f} s: {errors}")
    assert d.returncode == 2 and len(errors) == 1, (d.returncode, d_err[-3000:])
    assert f"--save {ck} is in use by another run (host " in errors[0] and ", pid " in errors[0], errors
    assert refused_in < 60, refused_in
    assert (ck / "step_000003" / "manifest.json").read_text() == manifest
    assert c.returncode == 75 and "stopped by SIGUSR1" in c_out, (c.returncode, c_err[-3000:])
    resumed = _metrics(tmp_path / "c.jsonl")
    assert "resumed from" in c_out and "resharding" not in c_out and resumed[0]["step"] == 4, c_out[-2000:]
    for got, want in zip(resumed[:2], uninterrupted[3:5]):
        print(f"step {got['step']}: resumed loss {got['loss']!r} grad norm {got['grad_norm']!r}; uninterrupted "
              f"{want['loss']!r} {want['grad_norm']!r}")
        assert (got["step"], got["loss"], got["grad_norm"]) == (want["step"], want["loss"], want["grad_norm"])


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path):
    subprocess.run([sys.executable, "tools/make_rollouts.py", str(tmp_path / "r.jsonl"), "--vocab", "512",
                    "--groups", "4", "--prompt-len", "40", "--group-size", "3", "--response-len", "6"],
                   cwd=ROOT, check=True, capture_output=True)
    p = _launch(2, "train", "--config", "configs/qwen3.6-tiny.yaml", "--rollouts", str(tmp_path / "r.jsonl"),
                "--steps", "8", "--save", str(tmp_path / "ck"), "--metrics-out", str(tmp_path / "m.jsonl"),
                "train.lr=1e30", "train.clip_grad=0", "train.max_bad_steps=2")
    out, err = p.communicate(timeout=600)
    m = _metrics(tmp_path / "m.jsonl")
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    print(f"exit {p.returncode}; updates {[x['update_ok'] for x in m]}, skipped {[x['skipped_updates'] for x in m]}; "
          f"{errors}")
    assert p.returncode == 3 and len(errors) == 1 and "step 3: 2 steps in a row had a non-finite loss" in errors[0]
    assert [x["update_ok"] for x in m] == [True, False, False] and m[-1]["skipped_updates"] == 2
    assert sorted(q.name for q in (tmp_path / "ck").glob("step_*")) == ["step_000003"]


def test_a_stuck_rank_ends_the_run_with_the_collective_named(tmp_path):
    """Rank 1 frozen (SIGSTOP: alive, silent, its heartbeat thread too) while rank 0 reaches a collective:
    with LONGSTRAW_DIST_TIMEOUT_S=5 rank 0 ends with exit 5 and one line naming the frozen rank and its
    host (its heartbeat stopped: parallel/peers.py), the call it waited in and the timeout; the launcher
    then ends the stuck rank (SIGTERM, SIGKILL) and passes 5 out. (A timeout while every peer still beats
    exits 4: tests/unit/test_peers.py.)"""
    import psutil

    subprocess.run([sys.executable, "tools/make_rollouts.py", str(tmp_path / "r.jsonl"), "--vocab", "512",
                    "--groups", "4", "--prompt-len", "200", "--group-size", "4", "--response-len", "12"],
                   cwd=ROOT, check=True, capture_output=True)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", LONGSTRAW_DIST_TIMEOUT_S="5",
               LONGSTRAW_FAIL_GRACE_S="2")
    p = subprocess.Popen(["bash", str(ROOT / "launch/local.sh"), "2", "train", "--config", "configs/qwen3.6-tiny.yaml",
                          "--rollouts", str(tmp_path / "r.jsonl"), "--steps", "50", "--metrics-out",
                          str(tmp_path / "m.jsonl"), "replay.chunk_len=16"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_steps(tmp_path / "m.jsonl", 1, p)
    ranks = [c for c in psutil.Process(p.pid).children(recursive=True) if c.environ().get("RANK") == "1"]
    assert len(ranks) == 1
    ranks[0].suspend()
    out, err = p.communicate(timeout=120)
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    print(f"exit {p.returncode}; {errors}")
    assert p.returncode == 5 and len(errors) == 1, (p.returncode, err[-3000:])
    host = socket.gethostname()
    assert f"error: rank 0 on {host}: lost ranks on {host} (rank 1): heartbeat stopped; " in errors[0]
    assert ".py:" in errors[0] and "Timed out waiting 5000ms" in errors[0]
