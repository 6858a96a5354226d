"""Start `python -m longstraw_mcore ARGS` on N local gloo ranks as a user would: through the project's
launcher (longstraw_mcore/launcher.py, what launch/local.sh runs)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def longstraw(n: int, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`env`: variables added to this process's environment for the run (leaving os.environ alone, so
    runs on several threads may each have their own)."""
    env = dict(os.environ, **(env or {}), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "longstraw_mcore.launcher", "--nproc", str(n), "--", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
