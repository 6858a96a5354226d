"""Which node is gone when a collective fails: heartbeats in the rendezvous store, and one line naming it.

`start(timeout)` (parallel/groups.init_distributed calls it once the default group exists, >1 rank) opens a
client connection of its own to the rendezvous store (torchrun's env:// store at MASTER_ADDR:MASTER_PORT,
served by rank 0), waiting for it as long as the rendezvous itself may (`timeout`:
parallel/timeout.rendezvous_timeout; at most CONNECT_CAP_S), writes this rank's host name there (from then on
its heartbeat is judged) and starts a daemon thread that adds 1 to this rank's counter every
LONGSTRAW_HEARTBEAT_S seconds (default 1; 0 turns it off); a beat may wait 30 s for the store (a store slowed
down by a loaded machine or by hundreds of ranks delays it; it never fails the run). The heartbeat is optional:
if the store takes no connection in that time, one line says so and the run goes on without it.

When a collective raises (a peer's connection closed: gloo's "Connection closed by peer"; or the
collective timeout), `diagnose()` marks this rank as a survivor, reads every rank's counter twice, three
heartbeats apart (waiting at most max(5, 5 x interval) seconds for a beat in flight and for each request, so
a diagnosis does not wait long for a store that is gone), and returns the ranks that registered, whose
counter stood still and that did not mark themselves: the lost ones. A rank without a
heartbeat is never named. A survivor whose own peer was another survivor that exited first still names the
node that went away, not that survivor's. Rank 0 serves the store, so after its own diagnosis it waits (at
most a few heartbeats) for the other survivors to finish theirs before it exits. A rank that cannot
reach the store names the store's host (rank 0's node). cli.py prints the line (`lost_line`) and exits
with EXIT_PEER_LOST (5); a timeout with every peer alive stays EXIT_TIMEOUT (4, a hang elsewhere).
`stop()` (cli.py's shutdown, and an atexit hook for any other caller) ends the thread, waiting for a beat in
flight: no thread may be inside the store client while the interpreter finalizes (`Heartbeat.close`).
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta

PREFIX = "longstraw/"
CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
                   "Connection refused", "ECONNRESET", "EPIPE")
"""Phrases of gloo's (and the TCP store's) errors when a peer's process or link is gone."""

_beat: "Heartbeat | None" = None


def interval_s() -> float:
    v = os.environ.get("LONGSTRAW_HEARTBEAT_S", "1")
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if s < 0:
        raise ValueError(f"LONGSTRAW_HEARTBEAT_S={v!r}: must be a number of seconds >= 0 (0: no heartbeat)")
    return s


CONNECT_CAP_S = 120.0
"""The most the heartbeat waits for its connection at start-up (less when the rendezvous's own timeout is
shorter): 24 times the fixed 5 s that failed a loaded 32-rank start, yet short enough that ranks whose heartbeat
gave up still reach their first collective well within its timeout (30 min on gloo, 10 on NCCL by default)."""


def connect(addr: str, port: int, timeout_s: float):
    """A client of the store at addr:port, tried until `timeout_s` seconds have passed (within one try TCPStore
    itself retries a refused or unanswered connection; a reset during its handshake raises at once, and is
    tried again here)."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(left, 1.0)),
                                 wait_for_workers=False)
        except Exception:
            if deadline - time.monotonic() <= 1.0:
                raise
            time.sleep(1.0)


class Heartbeat:
    """One rank's heartbeat (module docstring): one store connection, on which the thread beats (each request
    may wait `beat_s`) and a diagnosis reads (each request `diag_s`), one at a time. Connects before returning;
    raises when the store does not answer within `connect_s`."""

    def __init__(self, rank: int, world: int, addr: str, port: int, every_s: float, connect_s: float):
        self.rank, self.world, self.every_s, self.addr = rank, world, every_s, addr
        self.diag_s = max(5.0, 5 * every_s)
        self.beat_s = max(30.0, 10 * every_s)
        self.lock = threading.Lock()
        self.store = connect(addr, port, connect_s)
        self.store.set_timeout(timedelta(seconds=self.beat_s))
        self.store.set(f"{PREFIX}host/{rank}", socket.gethostname())  # registered: its counter is judged from now
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="longstraw-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                with self.lock:
                    self.store.add(f"{PREFIX}hb/{self.rank}", 1)
            except Exception:  # the store is gone (rank 0 ended, or its node), or silent for beat_s: no more beats
                return

    def close(self) -> None:
        """End the thread before the interpreter finalizes, waiting for a beat in flight (at most `beat_s`, its
        request's timeout). A daemon thread still inside the store client when the interpreter finalizes
        takes the GIL back into a finalizing interpreter, which ends the thread with pthread_exit through
        pybind11's C++ frames: std::terminate, SIGABRT ("terminate called without an active exception").
        Reproduced 6 of 6 times with a beat in flight during a slow finalization, 0 of 6 after a join
        (tests/unit/test_peers.py); the likely cause of a rank's SIGABRT at the end of a loaded run."""
        self.stopped.set()
        self.thread.join(timeout=self.beat_s + 1.0)

    def _read(self, fn):
        """`fn(store)` under the lock, with a diagnosis's short timeout: a beat in flight is waited for at most
        `diag_s`, and so is every request (a store that does not answer is unreachable, as far as a
        diagnosis can tell). Raises TimeoutError or the store's error."""
        if not self.lock.acquire(timeout=self.diag_s):
            raise TimeoutError(f"a heartbeat request to the store took over {self.diag_s:.0f} s")
        try:
            self.store.set_timeout(timedelta(seconds=self.diag_s))
            try:
                return fn(self.store)
            finally:
                self.store.set_timeout(timedelta(seconds=self.beat_s))
        finally:
            self.lock.release()

    def _counters(self) -> list[int]:
        return self._read(lambda st: [st.add(f"{PREFIX}hb/{r}", 0) for r in range(self.world)])

    def _have(self, what: str) -> list[bool]:
        return self._read(lambda st: [st.check([f"{PREFIX}{what}/{r}"]) for r in range(self.world)])

    def hosts(self) -> list[str]:
        known = self._have("host")
        return self._read(lambda st: [st.get(f"{PREFIX}host/{r}").decode() if known[r] else "?"
                                      for r in range(self.world)])

    def lost(self) -> tuple[list[int], list[str]]:
        """(the ranks with a heartbeat whose beats stopped and that did not mark themselves survivors, every
        rank's host)."""
        self._read(lambda st: st.set(f"{PREFIX}alive/{self.rank}", "1"))
        registered = self._have("host")  # (before the first count: a rank registering later is not judged)
        before = self._counters()
        time.sleep(3 * self.every_s)
        after = self._counters()
        marked = self._have("alive")
        lost = [r for r in range(self.world)
                if r != self.rank and registered[r] and after[r] == before[r] and not marked[r]]
        hosts = self.hosts()
        if self.rank == 0:  # the store lives in this process: let the other survivors read it first
            deadline = time.monotonic() + 5 * self.every_s
            while time.monotonic() < deadline:
                alive = self._have("alive")
                if all(alive[r] for r in range(self.world) if r not in lost and registered[r]):
                    break
                time.sleep(0.1)
        return lost, hosts


def start(timeout: timedelta) -> None:
    """Begin this rank's heartbeat (once; the env:// rendezvous variables must be set), its connection waiting
    up to `timeout` (the rendezvous's) or CONNECT_CAP_S, whichever is shorter. Never raises for an unreachable
    store: one line, and no heartbeat."""
    global _beat
    every = interval_s()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if _beat is not None or every == 0 or world < 2 or "MASTER_ADDR" not in os.environ:
        return
    rank, addr, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    t0 = time.monotonic()
    try:
        _beat = Heartbeat(rank, world, addr, port, every, min(timeout.total_seconds(), CONNECT_CAP_S))
        atexit.register(stop)  # (a caller that never stops it: the thread still ends before finalization)
    except Exception as e:  # noqa: BLE001 - optional: the run goes on without it
        print(f"[peers] rank {rank}: no heartbeat: the store at {addr}:{port} took no connection in "
              f"{time.monotonic() - t0:.0f} s ({cause(e)}); the run goes on, and a lost node will not be named",
              file=sys.stderr, flush=True)


def beating() -> bool:
    return _beat is not None


def stop() -> None:
    global _beat
    if _beat is not None:
        _beat.close()
        _beat = None


def is_connection_lost(e: BaseException) -> bool:
    return any(p in str(e) for p in CONNECTION_LOST)


def cause(e: BaseException) -> str:
    """gloo's own words, without its source location and advice: "Connection closed by peer [10.0.0.12]:3447"."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". ")[0][:160]


def _ranges(ranks: list[int]) -> str:
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def diagnose() -> str | None:
    """What is lost, as the middle of one line ("node2 (ranks 2-3)"), or None when every peer still beats
    (or there is no heartbeat to ask)."""
    if _beat is None:
        return None
    try:
        lost, hosts = _beat.lost()
    except Exception:  # the store cannot be reached: its host is the one gone from here
        return f"{_beat.addr} (rank 0's node, which serves the rendezvous store: unreachable from here)"
    if not lost:
        return None
    by_host: dict[str, list[int]] = {}
    for r in lost:
        by_host.setdefault(hosts[r], []).append(r)
    whole = [h for h, rs in by_host.items() if len(rs) == hosts.count(h)]
    return "; ".join(f"{'node ' if h in whole else 'ranks on '}{h} (rank{'s' if len(rs) > 1 else ''} {_ranges(rs)})"
                     for h, rs in by_host.items())


def lost_line(what: str, where: str, cause: str) -> str:
    rank = os.environ.get("RANK", "0")
    return (f"rank {rank} on {socket.gethostname()}: lost {what}: heartbeat stopped; {where} failed ({cause}); "
            "requeue the job to resume from its last checkpoint")
