"""Many one-rank CLI runs in ONE fresh interpreter: `longstraw_mcore.cli.main(argv)` per case, in order.

A fresh `python -m longstraw_mcore` pays the interpreter and torch's import (2-4 s) for a check that takes
milliseconds; bad-input cases need none of that per case. `run_cases(cases)` starts one child process that
calls `main()` for each argv and records, per case, what a separate process would have shown: the exit
status (a `SystemExit` from argparse included), everything written to file descriptors 1 and 2 (captured at the
descriptor, so logging handlers and C-level writes count too), and whether that case imported Megatron (the
child starts without it; the first case that imports it is the one named). Each case runs after the previous
one's process groups are closed (`main` closes those it made), from the project's root.

Use it for cases that exercise argument and input checks; keep real processes where the process boundary is
what is tested (the launcher, signals, locks, ranks, torchrun / mpirun / Slurm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cases(argvs: list[list[str]], timeout: float = 600, env: dict | None = None) -> list[dict]:
    """[{"code": int, "stdout": str, "stderr": str, "imported_megatron": bool}] per argv, in order."""
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d) / "cases.json", Path(d) / "results.json"
        spec.write_text(json.dumps(argvs))
        e = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, __file__, str(spec), str(out)], cwd=ROOT, env=e, timeout=timeout,
                           capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():
            raise AssertionError(f"the case runner exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())


def exit_status(argv: list[str]) -> int:
    """`cli.main(argv)`'s exit status as a process running it would end with: its return value, a SystemExit's
    code (argparse's 2), or 1 with the traceback on stderr for any other exception."""
    import traceback

    from longstraw_mcore import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a process
        traceback.print_exc()
        code = 1
    return int(code or 0)


def _capture(fn) -> tuple[int, str, str]:
    """Run fn() with fds 1 and 2 sent to temporary files; its exit status and what reached each."""
    files = [tempfile.TemporaryFile(mode="w+b") for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        code = fn()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    return code, texts[0], texts[1]


def _main(spec: str, out: str) -> int:
    results = []
    for argv in json.loads(Path(spec).read_text()):
        before = any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)
        code, so, se = _capture(lambda: exit_status(argv))
        after = any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)
        results.append({"code": code, "stdout": so, "stderr": se, "imported_megatron": after and not before})
        Path(out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))
