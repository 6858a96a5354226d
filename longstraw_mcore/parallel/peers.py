"""Which node is gone when a collective fails: heartbeats in the rendezvous store, and one line naming it.

`start()` (parallel/groups.init_distributed calls it once the default group exists, >1 rank) writes this
rank's host name to the rendezvous store (torchrun's env:// store at MASTER_ADDR:MASTER_PORT, served by
rank 0) and starts a daemon thread that adds 1 to this rank's counter there every
LONGSTRAW_HEARTBEAT_S seconds (default 1; 0 turns it off), over a client connection of its own.

When a collective raises (a peer's connection closed: gloo's "Connection closed by peer"; or the
collective timeout), `diagnose()` marks this rank as a survivor, reads every rank's counter twice, three
heartbeats apart, and returns the ranks whose counter stood still and that did not mark themselves:
the lost ones. A survivor whose own peer was another survivor that exited first still names the node
that went away, not that survivor's. Rank 0 serves the store, so after its own diagnosis it waits (at
most a few heartbeats) for the other survivors to finish theirs before it exits. A rank that cannot
reach the store names the store's host (rank 0's node). cli.py prints the line (`lost_line`) and exits
with EXIT_PEER_LOST (5); a timeout with every peer alive stays EXIT_TIMEOUT (4, a hang elsewhere).
"""

from __future__ import annotations

import os
import re
import socket
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


class Heartbeat:
    def __init__(self, rank: int, world: int, addr: str, port: int, every_s: float):
        import torch.distributed as dist

        self.rank, self.world, self.every_s, self.addr = rank, world, every_s, addr
        self.lock = threading.Lock()
        self.store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=max(5.0, 5 * every_s)),
                                   wait_for_workers=False)
        self.store.set(f"{PREFIX}host/{rank}", socket.gethostname())
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="longstraw-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                with self.lock:
                    self.store.add(f"{PREFIX}hb/{self.rank}", 1)
            except Exception:  # the store is gone (rank 0 ended, or its node): nothing more to say
                return

    def _counters(self) -> list[int]:
        with self.lock:
            return [self.store.add(f"{PREFIX}hb/{r}", 0) for r in range(self.world)]

    def hosts(self) -> list[str]:
        with self.lock:
            return [self.store.get(f"{PREFIX}host/{r}").decode() if self.store.check([f"{PREFIX}host/{r}"]) else "?"
                    for r in range(self.world)]

    def lost(self) -> tuple[list[int], list[str]]:
        """(the ranks whose heartbeat stopped and that did not mark themselves survivors, every rank's host)."""
        with self.lock:
            self.store.set(f"{PREFIX}alive/{self.rank}", "1")
        before = self._counters()
        time.sleep(3 * self.every_s)
        after = self._counters()
        with self.lock:
            marked = [self.store.check([f"{PREFIX}alive/{r}"]) for r in range(self.world)]
        lost = [r for r in range(self.world) if r != self.rank and after[r] == before[r] and not marked[r]]
        hosts = self.hosts()
        if self.rank == 0:  # the store lives in this process: let the other survivors read it first
            deadline = time.monotonic() + 5 * self.every_s
            while time.monotonic() < deadline:
                with self.lock:
                    if all(self.store.check([f"{PREFIX}alive/{r}"]) for r in range(self.world) if r not in lost):
                        break
                time.sleep(0.1)
        return lost, hosts


def start() -> None:
    """Begin this rank's heartbeat (once; the env:// rendezvous variables must be set)."""
    global _beat
    every = interval_s()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if _beat is not None or every == 0 or world < 2 or "MASTER_ADDR" not in os.environ:
        return
    _beat = Heartbeat(int(os.environ["RANK"]), world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), every)


def beating() -> bool:
    return _beat is not None


def stop() -> None:
    global _beat
    if _beat is not None:
        _beat.stopped.set()
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
