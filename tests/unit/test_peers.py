"""parallel/peers.py and cli.collective_failure, in one process: heartbeats through a real TCPStore (the
rendezvous store's kind) for three "ranks", one of which stops beating (a lost rank), one of which
marks itself a survivor and then stops (not lost); a rank whose heartbeat never connected is never named;
the line a survivor prints and the exit statuses (5 a peer gone, 4 a timeout while every peer beats, None
for any other error). Start-up: the heartbeat waits for a store that answers only after 6 s (the old fixed
connect timeout was 5 s: a loaded 32-rank start failed on it), and a store that never answers costs the run
one line, not its life. The multi-host case, a node's ranks SIGKILLed: tests/dist/test_multinode_slurm.py;
a frozen rank: tests/dist/test_stop_and_lock.py; many ranks starting on a loaded machine:
tests/dist/test_many_ranks_under_load.py."""

from __future__ import annotations

import os
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
    # (beats every 0.25 s, a diagnosis over 0.75 s: a loaded 2-core machine still runs each thread that often)
    hb = [peers.Heartbeat(r, 3, "127.0.0.1", master.port, every_s=0.25, connect_s=10) for r in range(3)]
    yield master, hb
    for h in hb:
        h.close()


def test_a_rank_whose_heartbeat_stops_is_lost_a_survivor_that_left_is_not(beats):
    master, hb = beats
    time.sleep(0.3)
    assert hb[0].lost()[0] == []  # everyone beats
    hb[2].close()  # rank 2 dies
    hb[1].lost()  # rank 1 saw the failure, marked itself, and leaves
    hb[1].close()
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
    hb[1].close()
    hb[2].close()
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


def test_a_rank_without_a_heartbeat_is_never_named():
    """World of 4 where rank 3's heartbeat never connected (its start-up line said so): its counter stands
    still, but it registered no host, so a diagnosis cannot tell whether it is gone and does not say it is."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    hb = [peers.Heartbeat(r, 4, "127.0.0.1", master.port, every_s=0.25, connect_s=10) for r in range(3)]
    try:
        time.sleep(0.3)
        assert hb[0].lost()[0] == []
        hb[2].close()
        lost, hosts = hb[1].lost()
        assert lost == [2] and hosts[3] == "?"
    finally:
        for h in hb:
            h.close()


LATE_STORE = """
import sys, time
from datetime import timedelta
time.sleep(6.0)
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, timeout=timedelta(seconds=60),
                      wait_for_workers=False)
print("serving", flush=True)
time.sleep(300)
"""

RANK = """
import sys, time
from datetime import timedelta
from longstraw_mcore.parallel import peers
t = time.monotonic()
peers.start(timedelta(seconds=120))
print("beating", peers.beating(), "after", round(time.monotonic() - t, 1), flush=True)

class SlowFinalization:  # what tearing down torch and Megatron on a loaded machine looks like
    def __del__(self):
        time.sleep(2.0)
keep = SlowFinalization()
sys.stdin.readline()  # the store is frozen now: a beat is in flight
peers.stop()  # as cli.py's shutdown does
sys.exit(0)
"""


def test_the_heartbeat_waits_for_a_slow_store_and_never_aborts_the_exit(monkeypatch):
    """Start-up: the store takes its first connection 6 s (and an import of torch) after the rank asks, beyond
    the fixed 5 s the heartbeat used to allow; the rank waits, as its rendezvous would have. Exit: the store
    is frozen (SIGSTOP) while a beat is in flight, the rank stops its heartbeat and exits, the store thaws
    during the rank's (slow) finalization. Before, the thread came back into a finalizing interpreter and the
    process died of SIGABRT ("terminate called without an active exception"); now stop() waits for it."""
    import signal
    import subprocess
    import sys

    from longstraw_mcore.launch_local import reserve_port

    held = reserve_port()
    port = str(held.getsockname()[1])
    store = subprocess.Popen([sys.executable, "-c", LATE_STORE, port], stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK="1",
               LONGSTRAW_HEARTBEAT_S="0.01")
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        started = rank.stdout.readline().split()
        assert store.stdout.readline().strip() == "serving"
        store.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        rank.stdin.write("exit\n")
        rank.stdin.flush()
        time.sleep(1.0)  # (the rank's interpreter is finalizing, or waiting for its beat)
        store.send_signal(signal.SIGCONT)
        _, err = rank.communicate(timeout=120)
    finally:
        for p in (rank, store):
            p.kill()
            p.wait()
        held.close()
    assert started[:2] == ["beating", "True"] and float(started[3]) >= 6.0, started
    assert rank.returncode == 0, (rank.returncode, err[-2000:])


def test_an_unreachable_store_costs_one_line_not_the_run(monkeypatch, capsys):
    from longstraw_mcore.launch_local import reserve_port

    held = reserve_port()  # (a port nothing listens on)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    try:
        peers.start(timedelta(seconds=2))
    finally:
        held.close()
    assert not peers.beating() and peers.diagnose() is None
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[peers]")]
    assert len(err) == 1 and "rank 1: no heartbeat" in err[0] and "the run goes on" in err[0], err
