"""The checkpoint directory on disk, without Megatron: which steps are published, whether a step's
files match its manifest, cleaning what a death left half-written. The command line's preflight uses
these before any process group exists; train/checkpoints.py writes and loads (see its docstring for
the layout and the publication order)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from longstraw_mcore.checkpoint.common import CheckpointError

MANIFEST = "manifest.json"
POINTS = ("model", "optimizer", "metadata", "published", "latest")
_STEP = re.compile(r"^step_(\d+)$")


CRITIC_DIR = "critic"
"""PPO's critic checkpoints: --save DIR/critic/step_N (its model and its optimizer; train/trainer.py)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def published_steps(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every published step under `root`, oldest first (no verification)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(out)


def clean_unpublished(root: str | Path) -> list[Path]:
    """Remove directories a death left half-written (`.step_*.partial`, `.step_*.stale`)."""
    removed = []
    for p in list(Path(root).glob(".step_*.partial")) + list(Path(root).glob(".step_*.stale")):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def write_manifest(directory: Path) -> None:
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1))
    os.replace(tmp, directory / MANIFEST)


def verify(directory: Path) -> str | None:
    """None if every file of the manifest is there with its recorded size; else what is wrong."""
    man = directory / MANIFEST
    try:
        files = json.loads(man.read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{man}: unreadable manifest ({type(e).__name__})"
    for rel, size in files.items():
        f = directory / rel
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, the manifest records {size}"
    return None


def newest_complete(root: str | Path, log=print) -> tuple[Path | None, list[str]]:
    """The newest step directory that verifies (or None when there are none at all), and the problems
    of the newer ones skipped. Raises CheckpointError when steps exist but none verifies."""
    steps = published_steps(root)
    problems = []
    for _, d in reversed(steps):
        problem = verify(d)
        if problem is None:
            return d, problems
        problems.append(problem)
    if problems:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(problems))
    return None, problems


def prune_steps(root: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` published step directories (train.keep_last; rank 0, after a
    save). A step directory is renamed out of the way first, so a death leaves either it or nothing."""
    assert keep >= 1, keep
    removed = []
    for _, d in published_steps(root)[:-keep]:
        gone = d.with_name(f".{d.name}.stale")
        os.replace(d, gone)
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(d)
    return removed
