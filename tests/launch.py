"""Run the CLI on N local gloo ranks.

`longstraw(n, ...)`: as a user would, through the project's launcher (longstraw_mcore/launcher.py, what
launch/local.sh runs): n fresh `python -m longstraw_mcore` processes. Use it where the process boundary is
under test (the launcher's lines and exit statuses, signals, locks, start-up, heartbeats).

`longstraw_forked(n, ...)`: the same CLI, `longstraw_mcore.cli.main(argv)`, on n ranks forked from the fork
server that has torch, Megatron and transformers imported (launch_local.run_ranks): no interpreter start and
no imports per rank (a fresh rank pays 4-7 CPU-seconds for them). Returns what `longstraw` returns: the exit
status (the first failing rank's, else 0), and stdout / stderr with each rank's lines prefixed "[rank R] " (for
n > 1) as the launcher prefixes them (ranks in order, not interleaved in time). The differences, which a test using it
must not depend on: the process group exists before `main` runs (made by run_ranks; no heartbeat, the default
timeouts), no "[launch]" lines, and the environment `env` is applied inside each rank.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def longstraw(n: int, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`env`: variables added to this process's environment for the run (leaving os.environ alone, so
    runs on several threads may each have their own)."""
    env = dict(os.environ, **(env or {}), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "longstraw_mcore.launcher", "--nproc", str(n), "--", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _cli_rank(rank: int, world: int, argv: list[str], folder: str, env: dict) -> int:
    """One rank of `longstraw_forked`: fds 1 and 2 to files, then the CLI's main(); its exit status."""
    os.chdir(ROOT)
    os.environ.update(env)
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(folder, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from cli_in_process import exit_status

    code = exit_status(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def longstraw_forked(n: int, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    from longstraw_mcore.launch_local import run_ranks

    with tempfile.TemporaryDirectory() as d:
        codes = run_ranks(_cli_rank, n, list(args), d, dict(env or {}, OMP_NUM_THREADS="1"), timeout_s=timeout)

        def joined(name):
            out = []
            for r in range(n):
                with open(os.path.join(d, f"{r}.{name}"), errors="replace") as f:
                    pre = f"[rank {r}] " if n > 1 else ""  # (as the launcher: a prefix when there are ranks to tell)
                    out += [pre + line for line in f.read().splitlines(keepends=True)]
            return "".join(out)

        failed = [c for c in codes if c != 0]
        return subprocess.CompletedProcess(["longstraw_forked", str(n), *args], failed[0] if failed else 0,
                                           joined("out"), joined("err"))
