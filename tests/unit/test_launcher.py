"""longstraw_mcore/launcher.py with stand-in ranks (small Python programs in place of `python -m
longstraw_mcore ...`, so no rank imports Megatron): each rank's environment (global rank from the node
rank, world, master), console lines prefixed with the global rank and the same lines unprefixed in
DIR/node<R>/rank<global>.log; a signal to the launcher reaches every rank once; the exit status is the
first failing rank's (a rank killed by signal S: 128 + S); ranks still running after one failed are
terminated after the grace period. The real ranks through launch/local.sh: tests/dist/test_stop_and_lock.py."""

from __future__ import annotations

import signal
import sys
import threading
import time

from longstraw_mcore.launcher import Ranks, rank_env

RANK = "import os, sys, time, signal\nr = int(os.environ['RANK'])\n"


def _run(code: str, nproc: int, tmp_path, node_rank: int = 0, nnodes: int = 1, grace: float = 30.0, after=None):
    ranks = Ranks([sys.executable, "-c", RANK + code], nproc, nnodes, node_rank, "127.0.0.1", 12345,
                  str(tmp_path / "logs"))
    if after is not None:
        threading.Timer(1.5, after, args=(ranks,)).start()
    t0 = time.monotonic()
    return ranks.wait(grace), time.monotonic() - t0


def test_environment_prefixes_and_logs(tmp_path, capfd):
    assert rank_env({}, 4, 2, 1, 3, "h0", 20001) == {
        "RANK": "7", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "h0", "MASTER_PORT": "20001"}
    code, _ = _run("print(f'hello from {r} of {os.environ[\"WORLD_SIZE\"]}'); print('oops', file=sys.stderr)", 2,
                   tmp_path, node_rank=1, nnodes=2)
    out, err = capfd.readouterr()
    assert code == 0
    assert "[rank 2] hello from 2 of 4" in out and "[rank 3] hello from 3 of 4" in out and "[rank 3] oops" in err
    # (stdout and stderr are two pipes read by two threads: their lines interleave in either order)
    assert sorted((tmp_path / "logs/node1/rank3.log").read_text().splitlines()) == ["hello from 3 of 4", "oops"]


def test_signals_reach_every_rank_and_the_status_is_theirs(tmp_path, capfd):
    wait_for_usr1 = ("signal.signal(signal.SIGUSR1, lambda *a: (print('usr1', flush=True), sys.exit(75)))\n"
                     "time.sleep(60)\n")
    code, took = _run(wait_for_usr1, 3, tmp_path, after=lambda ranks: ranks.send(signal.SIGUSR1))
    out, _ = capfd.readouterr()
    assert code == 75 and took < 20 and all(f"[rank {r}] usr1" in out for r in range(3)), (code, out)
    code, _ = _run("sys.exit(2)", 2, tmp_path)
    assert code == 2  # bad input: the project's status, not a launcher's own
    code, _ = _run("os.kill(os.getpid(), signal.SIGKILL) if r == 1 else None", 2, tmp_path)
    assert code == 128 + signal.SIGKILL


def test_a_failed_rank_ends_the_others_after_the_grace(tmp_path, capfd):
    code, took = _run("sys.exit(3) if r == 1 else time.sleep(120)", 2, tmp_path, grace=1.0)
    _, err = capfd.readouterr()
    assert code == 3 and took < 15, (code, took)
    assert "rank 1 exited with status 3; ranks [0] still run after 1 s: terminating them" in err, err


def test_a_rank_aborted_in_native_code_is_named_with_its_stack(tmp_path, capfd):
    """The guard for an abort inside native code (a gloo thread's std::terminate: SIGABRT): the rank leaves
    the Python stack of every thread on its stderr (cli.main enables faulthandler; the same call here) and the
    launcher's one line names the rank and the signal."""
    code, _ = _run("import faulthandler\nfaulthandler.enable(all_threads=True)\n"
                   "def deep_in_a_step():\n    os.abort()\n"
                   "deep_in_a_step() if r == 1 else None", 2, tmp_path)
    _, err = capfd.readouterr()
    assert code == 128 + signal.SIGABRT
    assert "[launch] rank 1 was killed by SIGABRT (status 134: inside native code" in err, err
    assert "[rank 1] Fatal Python error: Aborted" in err and "in deep_in_a_step" in err, err


def test_the_command_line_turns_the_stack_dump_on(monkeypatch, capsys):
    import faulthandler

    from longstraw_mcore import cli

    calls = []
    monkeypatch.setattr(faulthandler, "enable", lambda **kw: calls.append(kw))  # (pytest's own stays on)
    assert cli.main(["check", "--config", "configs/qwen3.6-tiny.yaml"]) == 0
    assert calls == [{"file": sys.__stderr__, "all_threads": True}] and isinstance(sys.stdout, cli.Console)


def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    """A launcher killed outright (SIGKILL: it forwards nothing) leaves no rank running in its own session:
    each rank asked the kernel for SIGTERM on the launcher's death (launcher.die_with_launcher, which cli.main
    calls), and ends."""
    import os
    import subprocess

    rank = ("from longstraw_mcore.launcher import die_with_launcher\ndie_with_launcher()\n"
            f"open('{tmp_path}/rank' + os.environ['RANK'], 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    launcher = ("import sys\nfrom longstraw_mcore.launcher import Ranks\n"
                f"sys.exit(Ranks([sys.executable, '-c', {RANK + rank!r}], 2, 1, 0, '127.0.0.1', 1, None).wait(30))")
    p = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.1)
        time.sleep(0.2)
        pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
        p.kill()
        p.wait()
        deadline = time.monotonic() + 20
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in pids if _running(pid)]
            time.sleep(0.1)
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        p.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
