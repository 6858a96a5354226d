"""parallel/peers.py and cli.collective_failure, in one process: heartbeats through a real TCPStore (the
rendezvous store's kind) for three "ranks", one of which stops beating (a lost rank), one of which
marks itself a survivor and then stops (not lost); the line a survivor prints and the exit statuses
(5 a peer gone, 4 a timeout while every peer beats, None for any other error). The multi-host case,
a node's ranks SIGKILLed: tests/dist/test_multinode_slurm.py; a frozen rank: tests/dist/test_stop_and_lock.py."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from longstraw_mcore import cli
from longstraw_mcore.parallel import peers


@pytest.fixture
def beats(monkeypatch):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    hb = [peers.Heartbeat(r, 3, "127.0.0.1", master.port, every_s=0.05) for r in range(3)]
    yield master, hb
    for h in hb:
        h.stopped.set()


def test_a_rank_whose_heartbeat_stops_is_lost_a_survivor_that_left_is_not(beats):
    master, hb = beats
    time.sleep(0.2)
    assert hb[0].lost()[0] == []  # everyone beats
    hb[2].stopped.set()  # rank 2 dies
    hb[1].lost()  # rank 1 saw the failure, marked itself, and leaves
    hb[1].stopped.set()
    time.sleep(0.1)
    lost, hosts = hb[0].lost()
    assert lost == [2] and hosts == [socket.gethostname()] * 3


def test_the_line_and_the_exit_status(beats, monkeypatch, capsys):
    master, hb = beats
    monkeypatch.setattr(peers, "_beat", hb[0])
    monkeypatch.setenv("RANK", "0")
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                          "[10.213.0.12]:34474. This is typically caused by a remote worker crashing.")
    assert peers.cause(closed) == "Connection closed by peer [10.213.0.12]:34474"
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation")
    assert cli.collective_failure(timeout) == cli.EXIT_TIMEOUT  # every peer beats: stuck elsewhere
    assert "every peer's heartbeat still runs" in capsys.readouterr().err
    hb[1].stopped.set()
    hb[2].stopped.set()
    assert cli.collective_failure(closed) == cli.EXIT_PEER_LOST
    err = capsys.readouterr().err.strip().splitlines()
    host = socket.gethostname()
    assert err == [f"error: rank 0 on {host}: lost ranks on {host} (ranks 1-2): heartbeat stopped; an unknown call failed "
                   "(Connection closed by peer [10.213.0.12]:34474); requeue the job to resume from its last checkpoint"]
    assert cli.collective_failure(RuntimeError("shape mismatch")) is None


def test_without_a_heartbeat_and_without_the_store(beats, monkeypatch, capsys):
    master, hb = beats
    monkeypatch.setattr(peers, "_beat", None)
    timeout = RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    assert cli.collective_failure(timeout) == cli.EXIT_TIMEOUT
    assert "a peer rank stopped or is stuck elsewhere" in capsys.readouterr().err
    assert peers.diagnose() is None
    monkeypatch.setattr(peers, "_beat", hb[1])
    monkeypatch.setattr(hb[1], "store", None)  # any call on it fails, as on a store whose host is gone
    assert peers.diagnose() == "127.0.0.1 (rank 0's node, which serves the rendezvous store: unreachable from here)"
    assert peers._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    monkeypatch.setenv("LONGSTRAW_HEARTBEAT_S", "-1")
    with pytest.raises(ValueError, match="LONGSTRAW_HEARTBEAT_S='-1'"):
        peers.interval_s()
