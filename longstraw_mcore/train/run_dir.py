"""One run per `--save` directory, and who that run is.

Lock: `ROOT/.lock` holds {host, pid, job (SLURM_JOB_ID or null), since}; global rank 0 creates it with
O_EXCL after the process group exists and before anything is written, and every rank learns the
outcome (one broadcast), so a refused run stops on all ranks at once with one line naming the
directory and the holder (exit 2). A lock is stale, and taken over with a message, when its holder is
a process gone from this host, or the same Slurm job (a requeued job restarts, possibly on another
node); a lock of a live process, or of another host not in this job, is respected: the message says
how to remove it by hand when its holder is known to be dead. Released (only if still ours) when the
run ends, also on an error.

Identity: `ROOT/run.json` holds {job, config_hash, command}. A rerun of the same Slurm job with the same
config (a requeue: Slurm reruns the job's command line, which has no --resume) resumes from the newest
checkpoint by itself; any other run on a directory with checkpoints still needs --resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path

LOCK = ".lock"
IDENTITY = "run.json"


def config_hash(cfg) -> str:
    """What must not change across a requeue: the whole config (layout included), as its JSON."""
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['job']}" if holder.get("job") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {since}"


def stale(holder: dict) -> str | None:
    """Why the lock of `holder` may be taken over, or None when it must be respected."""
    if holder.get("job") and holder.get("job") == job_id():
        return f"it is this Slurm job's ({holder['job']}): the job was requeued"
    if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", -1))):
        return f"its process {holder.get('pid')} is gone from this host"
    return None


def try_lock(root: str | Path, log=print) -> str | None:
    """Take ROOT/.lock for this process; None when taken, else the line saying who holds it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            why = stale(holder) if holder else "it is unreadable"
            if why is None:
                return (f"--save {root} is in use by another run ({describe(holder)}): one run per directory. If that "
                        f"run is dead, remove {path} and start again")
            log(f"[train] taking over the lock of {root} ({describe(holder) if holder else path}): {why}")
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return None
    return f"--save {root}: could not take {path} (another run took it at the same moment)"


def release(root: str | Path) -> None:
    """Remove ROOT/.lock if this process holds it."""
    path = Path(root) / LOCK
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def write_identity(root: str | Path, cfg, argv: list[str]) -> None:
    root = Path(root)
    tmp = root / f".{IDENTITY}.tmp"
    tmp.write_text(json.dumps({"job": job_id(), "config_hash": config_hash(cfg), "command": argv}, indent=1))
    os.replace(tmp, root / IDENTITY)


def same_job(root: str | Path, cfg) -> bool:
    """Whether ROOT was written by this Slurm job with this config (a requeued job resumes by itself)."""
    if job_id() is None:
        return False
    try:
        ident = json.loads((Path(root) / IDENTITY).read_text())
    except (OSError, ValueError):
        return False
    return ident.get("job") == job_id() and ident.get("config_hash") == config_hash(cfg)
