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


_HELD_PORT = """
import os, socket
import longstraw_mcore.launch_local as ll
held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen(1)
port, picks, pick = held.getsockname()[1], [], ll.free_port
ll.free_port = lambda: (picks.append(1), port if len(picks) == 1 else pick())[1]
from longstraw_mcore.parallel.groups import init_distributed
import torch.distributed as dist
init_distributed("cpu")
print("ranks", dist.get_world_size(), "picks", len(picks), "other port", os.environ["MASTER_PORT"] != str(port))
"""


def test_a_one_process_launch_picks_another_port_when_its_first_is_taken():
    """A plain one-process launch picks its rendezvous port itself (launch_local.free_port releases it before
    the store binds it): a port another process took in between (EADDRINUSE, seen once in CI) is picked again."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, "-c", _HELD_PORT], env=dict(env, PYTHONPATH=root), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ranks 1 picks 2 other port True" in r.stdout, r.stdout
