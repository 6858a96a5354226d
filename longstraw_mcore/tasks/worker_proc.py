"""The parent's end of the user-code worker processes (tasks/user_worker.py): WorkerProc spawns one, sends
it a JSON line, reads JSON lines without blocking, kills it; WorkerSet runs requests over a few of them,
each with a deadline, replacing a process that hangs or dies.

The worker runs `sys.executable -u user_worker.py` with stdin/stdout pipes and the parent's stderr, in the
parent's cwd, with PYTHONPATH = the parent's sys.path, so `module:function` imports there as it would here.
Reads go through os.read into a buffer (never a blocking readline), so the pool can poll many workers and
time each one out; a worker is one request deep, so at most one reply is ever outstanding. A timeout or a
crash becomes a reply like any other: {"ok": false, "kind": "timeout" | "crash", "cause": ...}."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("user_worker.py")


def encode(msg: dict) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def worker_env() -> dict[str, str]:
    """The environment of a worker: ours, with PYTHONPATH = our sys.path ('' is the cwd)."""
    paths = list(dict.fromkeys(os.path.abspath(p) if p else os.getcwd() for p in sys.path))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class WorkerProc:
    """One live worker process; `generation` tells a respawned slot from the process it replaced."""

    def __init__(self, env: dict[str, str], cwd: str, generation: int):
        self.proc = subprocess.Popen([sys.executable, "-u", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=cwd)
        self.fd = self.proc.stdout.fileno()
        self.generation = generation
        self._buf = bytearray()

    def send(self, msg: dict | bytes) -> bool:
        """Write one request (or its encoded line); False if the worker is gone (a broken pipe)."""
        try:
            self.proc.stdin.write(msg if isinstance(msg, bytes) else encode(msg))
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def read(self) -> dict | None | bool:
        """After poll said readable: the reply if a whole line has arrived, False if not yet, None at EOF."""
        data = os.read(self.fd, 1 << 20)
        if not data:
            return None
        self._buf += data
        line, sep, rest = bytes(self._buf).partition(b"\n")
        if not sep:
            return False
        self._buf = bytearray(rest)
        return json.loads(line)

    def wait_reply(self, deadline: float) -> dict | None | bool:
        """Block until a reply (dict), EOF (None) or `deadline` (time.monotonic; False)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(left * 1000):
                reply = self.read()
                if reply is not False:
                    return reply
        return False

    def exit_cause(self) -> str:
        """Why the worker ended, once it has: 'exited with code 3' / 'killed by SIGSEGV'."""
        try:
            rc = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.kill()
            return "closed its output and was killed"
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with code {rc}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def stop(self, grace_s: float = 1.0) -> None:
        """Close its input (the worker's loop ends) and wait `grace_s`; kill it if still running."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class WorkerSet:
    """`n` worker slots, each running one request at a time. Every process gets `load_request` first (the
    user's imports); a slot whose process hangs past `timeout_s` or dies gets a fresh one, and its
    `generation(slot)` goes up (state the old process held, such as environment episodes, is lost)."""

    def __init__(self, n: int, timeout_s: float, load_request: dict, load_timeout_s: float):
        self.timeout_s, self.load_request, self.load_timeout_s = timeout_s, load_request, load_timeout_s
        self._env, self._cwd = worker_env(), os.getcwd()
        self.procs: list[WorkerProc] = []
        try:
            for _ in range(n):  # all import at once
                self.procs.append(WorkerProc(self._env, self._cwd, 0))
                self.procs[-1].send(load_request)
        except BaseException:
            self.close()
            raise

    def load(self) -> dict:
        """The load replies: the first failed one, else the first ({"ok": true, ...}; all are alike). A
        worker that exits or takes over load_timeout_s fails with "index": None."""
        deadline = time.monotonic() + self.load_timeout_s
        replies = [self._loaded(p, deadline) for p in self.procs]
        return next((r for r in replies if not r["ok"]), replies[0])

    def _loaded(self, p: WorkerProc, deadline: float) -> dict:
        reply = p.wait_reply(deadline)
        if reply is None:
            return {"ok": False, "index": None, "cause": f"the worker importing them {p.exit_cause()}"}
        if reply is False:
            return {"ok": False, "index": None, "cause": f"importing them took over {self.load_timeout_s:g} s"}
        return reply

    def generation(self, slot: int) -> int:
        return self.procs[slot].generation

    def _respawn(self, slot: int) -> None:
        old = self.procs[slot]
        old.kill()
        self.procs[slot] = p = WorkerProc(self._env, self._cwd, old.generation + 1)
        p.send(self.load_request)
        reply = self._loaded(p, time.monotonic() + self.load_timeout_s)
        if not reply["ok"]:
            raise RuntimeError(f"respawning a user-code worker failed: {reply['cause']}")

    def _crashed(self, slot: int) -> dict:
        cause = f"worker {self.procs[slot].exit_cause()}"
        self._respawn(slot)
        return {"ok": False, "kind": "crash", "cause": cause}

    def run(self, jobs: list[tuple[int | None, int | None, dict]]) -> list[dict]:
        """Replies to `jobs` = (slot and its generation, or None, None for any slot; request), in job order.
        Slots take jobs in job order, the lowest free slot first. A job pinned to a slot whose generation
        has moved on fails as a crash without running."""
        assert self.procs, "the workers were closed"
        lines = [encode(request) for _, _, request in jobs]  # a row json cannot write fails here, before any send
        busy: dict[int, tuple[int, float]] = {}  # slot -> (job, deadline)
        try:
            return self._run(jobs, lines, busy)
        except BaseException:  # (Ctrl-C) a busy worker's late reply must not answer the next run's job
            for slot in busy:
                try:
                    self._respawn(slot)
                except Exception:
                    pass
            raise

    def _run(self, jobs: list, lines: list[bytes], busy: dict[int, tuple[int, float]]) -> list[dict]:
        replies: list = [None] * len(jobs)
        pending = list(range(len(jobs)))
        while pending or busy:
            waiting = []
            for j in pending:
                want, generation, _ = jobs[j]
                slots = [want] if want is not None else range(len(self.procs))
                slot = next((s for s in slots if s not in busy), None)
                if slot is None:
                    waiting.append(j)
                elif generation is not None and self.procs[slot].generation != generation:
                    replies[j] = {"ok": False, "kind": "crash", "cause": "its worker was restarted meanwhile"}
                elif self.procs[slot].send(lines[j]):
                    busy[slot] = (j, time.monotonic() + self.timeout_s)
                else:
                    replies[j] = self._crashed(slot)
            pending = waiting
            if not busy:
                continue
            fds = {self.procs[s].fd: s for s in busy}
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            wait_s = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            for fd, _ in poller.poll(wait_s * 1000):  # replies already waiting are taken before any timeout
                slot = fds[fd]
                reply = self.procs[slot].read()
                if reply is not False:
                    replies[busy.pop(slot)[0]] = reply if reply is not None else self._crashed(slot)
            now = time.monotonic()
            for slot, (j, deadline) in list(busy.items()):
                if deadline <= now:
                    del busy[slot]
                    self._respawn(slot)
                    replies[j] = {"ok": False, "kind": "timeout",
                                  "cause": f"no answer in {self.timeout_s:g} s (worker killed and respawned)"}
        return replies

    def send(self, slot: int, msg: dict) -> None:
        """A request without a reply (env_close); a dead worker is found by the next run()."""
        self.procs[slot].send(msg)

    def close(self) -> None:
        """Close every worker's input (its loop ends), then reap; one still running after 1 s is killed."""
        procs, self.procs = self.procs, []
        for p in procs:
            try:
                p.proc.stdin.close()
            except OSError:
                pass
        for p in procs:
            p.stop()
