"""The spawn harness: results in rank order, a rank's failure re-raised with its traceback, and a
hung rank killed together with its children on timeout (a hung test must never hang CI)."""

from __future__ import annotations

import os
import time

import pytest

from longstraw_mcore.launch_local import RankFailure, run_ranks


def _allreduce_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, world_size, float(t)


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _hang_with_child(rank, world_size, pidfile):
    import subprocess

    child = subprocess.Popen(["sleep", "300"])
    with open(f"{pidfile}.{rank}", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(300)


def test_results_in_rank_order():
    assert run_ranks(_allreduce_rank, 3, timeout_s=120) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_failure_reraised_with_traceback():
    with pytest.raises(RankFailure) as e:
        run_ranks(_fail_on_rank_1, 2, timeout_s=120)
    assert "rank 1 of 2 failed" in str(e.value) and "ValueError: boom from rank one" in str(e.value)
    assert "_fail_on_rank_1" in str(e.value)  # the rank's own traceback


def test_timeout_kills_ranks_and_their_children(tmp_path):
    pidfile = str(tmp_path / "pids")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 still running after 8 s"):
        run_ranks(_hang_with_child, 2, pidfile, timeout_s=8)
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    for r in range(2):
        for pid in map(int, open(f"{pidfile}.{r}").read().split()):
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    assert f.read().split()[2] == "Z", f"pid {pid} (rank {r}) survived the timeout"
            except ProcessLookupError:
                pass


def test_free_port_in_the_given_range(monkeypatch):
    """LONGSTRAW_PORTS=LO-HI (each pytest worker's own range, tests/conftest.py): a port in it that is free,
    passing over one that is taken; a malformed range is refused naming it."""
    import socket

    from longstraw_mcore.launch_local import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        lo = taken if taken < 65535 else taken - 1
        monkeypatch.setenv("LONGSTRAW_PORTS", f"{lo}-{lo + 1}")
        got = {free_port() for _ in range(8)}
        assert got == {lo, lo + 1} - {taken}, (got, taken)
    for bad in ("20000", "x-y", "30000-20000", "80-90"):
        monkeypatch.setenv("LONGSTRAW_PORTS", bad)
        with pytest.raises(ValueError, match=f"LONGSTRAW_PORTS='{bad}'"):
            free_port()


def test_a_reserved_port_is_taken_by_nothing_but_the_store():
    """launch_local.reserve_port: while the launcher holds the port, another launch's choice (a plain bind)
    is refused, yet rank 0's store binds it beside the held socket and serves it."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from longstraw_mcore.launch_local import reserve_port

    held = reserve_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                               wait_for_workers=False)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        held.close()
