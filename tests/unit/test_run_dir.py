"""train/run_dir.py: the --save lock and the run identity, case by case (the lock against a live run
launched as a user would: tests/dist/test_stop_and_lock.py; a requeued Slurm job: tests/dist/test_multinode_slurm.py).

- a free directory is taken; a live holder (this process, or a process on another host) is respected
  with one line naming the directory, the host, the pid and the job; a holder whose process is gone from
  this host, an unreadable lock, or this Slurm job's own lock (a requeue) is taken over, with a message;
- release removes only this process's lock;
- the identity: the same Slurm job with the same config resumes by itself; another job, no job, or a
  changed config does not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from longstraw_mcore.config import load_config
from longstraw_mcore.train import run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _hold(root, **holder):
    (root / run_dir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": None,
                                                 "since": 0, **holder}))


def test_lock_cases(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    said = []
    root = tmp_path / "ck"
    assert run_dir.try_lock(root, said.append) is None and (root / run_dir.LOCK).is_file()
    refused = run_dir.try_lock(root, said.append)  # held by a live process (this one)
    assert refused.startswith(f"--save {root} is in use by another run (host {socket.gethostname()}, pid {os.getpid()}")
    assert "remove" in refused and str(root / run_dir.LOCK) in refused and not said
    _hold(root, host="elsewhere", pid=1, job="11")
    refused = run_dir.try_lock(root, said.append)
    assert "host elsewhere, pid 1, Slurm job 11" in refused
    for holder, why in ((dict(pid=_dead_pid()), "is gone from this host"), (dict(host="elsewhere", job="42"), "requeued")):
        monkeypatch.setenv("SLURM_JOB_ID", "42")
        _hold(root, **holder)
        said.clear()
        assert run_dir.try_lock(root, said.append) is None and why in said[0], said
        assert json.loads((root / run_dir.LOCK).read_text())["pid"] == os.getpid()
    (root / run_dir.LOCK).write_text("{not json")
    said.clear()
    assert run_dir.try_lock(root, said.append) is None and "unreadable" in said[0]
    _hold(root, pid=1)  # not ours: release leaves it
    run_dir.release(root)
    assert (root / run_dir.LOCK).is_file()
    _hold(root)
    run_dir.release(root)
    assert not (root / run_dir.LOCK).exists()


def test_identity_resumes_only_the_same_job_with_the_same_config(tmp_path, monkeypatch):
    cfg = load_config(os.path.join(ROOT, "configs/qwen3.6-tiny.yaml"))
    other = load_config(os.path.join(ROOT, "configs/qwen3.6-tiny.yaml"), ["train.lr=0.5"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    run_dir.write_identity(tmp_path, cfg, ["longstraw", "train"])
    assert run_dir.same_job(tmp_path, cfg) and not run_dir.same_job(tmp_path, other)
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    assert not run_dir.same_job(tmp_path, cfg)
    monkeypatch.delenv("SLURM_JOB_ID")
    assert not run_dir.same_job(tmp_path, cfg)
