"""Start one node's ranks of a longstraw subcommand, and be a well-behaved process for a scheduler.

  python -m longstraw_mcore.launcher --nproc N [--nnodes M --node-rank R --master-addr HOST]
      [--master-port P] [--log-dir DIR] -- SUBCOMMAND ARGS...

Each rank is `python -m longstraw_mcore SUBCOMMAND ARGS...` with torch.distributed's environment
(RANK = R x N + local rank, WORLD_SIZE = M x N, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
init_process_group's env:// rendezvous at node 0). What torchrun did for this project, without its
elastic agent, because of what a real Slurm showed (docs/cluster.md):
- signals: SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to the launcher go to every rank once (the
  ranks run in their own session, so a terminal's Ctrl-C reaches them only this way); a launcher that
  dies (SIGKILL, a crash) leaves no rank running: each gets SIGTERM from the kernel (`die_with_launcher`);
  `train` stops at its next safe point on SIGTERM / SIGUSR1 (train/stop.py). torchrun's agent dies of
  SIGUSR1 and kills the ranks 30 s after a SIGTERM whatever they are doing;
- exit status: the ranks' own. 0 when every rank exits 0; otherwise the status of the first rank that
  failed (2: bad input, 3: diverged, 4: a collective timed out, 5: a peer lost, 75: stopped on a signal
  with a checkpoint; a rank killed by signal
  S: 128 + S), not torchrun's 1 above a ~45-line traceback. When a rank fails while others still run
  (they may wait in a collective it will never join), they get `--grace` seconds, then SIGTERM, then
  SIGKILL 10 s later;
- output: every line of a multi-rank run is prefixed with its global rank (`[rank 5] ...`) on the
  console, and with --log-dir also written unprefixed to DIR/node<R>/rank<global>.log (node R: this
  launcher's --node-rank, the one the ranks' global numbers come from).
The master port, when not given: free on this host for one node, and held by the launcher until the ranks end
(launch_local.reserve_port: neither another launch's choice nor an outgoing connection takes it before rank
0's store binds it); a cluster launch passes the one it derived from the job id (cluster.py), so two jobs on
one node do not meet.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def rank_env(env: dict, nproc: int, nnodes: int, node_rank: int, local: int, addr: str, port: int) -> dict:
    """The environment of local rank `local` of node `node_rank`."""
    return dict(env, RANK=str(node_rank * nproc + local), WORLD_SIZE=str(nnodes * nproc), LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node_rank), MASTER_ADDR=addr, MASTER_PORT=str(port))


LAUNCHER_PID = "LONGSTRAW_LAUNCHER_PID"
"""Set in each rank's environment: the launcher's pid, for `die_with_launcher`."""


def die_with_launcher() -> None:
    """In a rank this launcher started (cli.main calls it): the kernel sends it SIGTERM when the launcher dies
    (Linux's PR_SET_PDEATHSIG), so a rank left alone stops as on a scheduler's SIGTERM (train: at its next safe
    point, with a checkpoint) rather than running on unheard in its own session. The variable is taken out of
    the environment, so the rank's own children never act on it. Elsewhere (no launcher, not Linux): nothing."""
    pid = os.environ.pop(LAUNCHER_PID, None)
    if not pid or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(pid):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _pump(stream, out, prefix: str, log, lock: threading.Lock) -> None:
    """A rank's lines to the console (prefixed) and its log. A destination that fails (the console's reader
    gone, the log's disk full) is dropped, and the pipe is still drained: a rank never blocks on a full pipe
    because the launcher's own output failed."""
    sinks = [(out, prefix), (log, "")] if log is not None else [(out, prefix)]
    for line in iter(stream.readline, ""):
        with lock:
            for i, (dest, pre) in enumerate(sinks):
                if dest is None:
                    continue
                try:
                    dest.write(pre + line)
                    dest.flush()
                except (OSError, ValueError):
                    sinks[i] = (None, pre)
    stream.close()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # Popen: -S for a rank killed by signal S


def _ended(rank: int, status: int) -> str:
    """"rank 1 exited with status 1", or for a signal "rank 1 was killed by SIGABRT (status 134: inside native
    code; the Python stack of each of its threads is in its output)" (cli.py enables faulthandler)."""
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = f"signal {status - 128}"
        native = status - 128 in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
        return (f"rank {rank} was killed by {name} (status {status}" + (": inside native code; the Python stack "
                "of each of its threads is in its output" if native else "") + ")")
    return f"rank {rank} exited with status {status}"


class Ranks:
    """This node's rank processes, their output pumps and the forwarding of signals."""

    def __init__(self, command: list[str], nproc: int, nnodes: int, node_rank: int, addr: str, port: int,
                 log_dir: str | None):
        """`command`: what every rank runs (`python -m longstraw_mcore SUBCOMMAND ARGS...`)."""
        self.lock = threading.Lock()
        self.procs, self.threads, self.logs = [], [], []
        world = nproc * nnodes
        node_dir = Path(log_dir) / f"node{node_rank}" if log_dir else None
        if node_dir is not None:
            node_dir.mkdir(parents=True, exist_ok=True)
        for local in range(nproc):
            rank = node_rank * nproc + local
            env = rank_env(dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCHER_PID: str(os.getpid())}), nproc, nnodes,
                           node_rank, local, addr, port)
            p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                                 start_new_session=True)
            log = open(node_dir / f"rank{rank}.log", "a") if node_dir is not None else None
            self.logs.append(log)
            prefix = f"[rank {rank}] " if world > 1 else ""
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, prefix, log, self.lock), daemon=True)
                t.start()
                self.threads.append(t)
            self.procs.append((rank, p))

    def send(self, sig: int) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, grace_s: float) -> int:
        """Every rank's end; the run's exit status (module docstring)."""
        first, failed_at, termed_at = None, None, None
        while True:
            codes = [(r, p.poll()) for r, p in self.procs]
            for r, c in codes:
                if c not in (None, 0) and first is None:
                    first, failed_at = (r, _status(c)), time.monotonic()
            alive = [r for r, c in codes if c is None]
            if not alive:
                break
            now = time.monotonic()
            if failed_at is not None and termed_at is None and now - failed_at > grace_s:
                self._say(f"{_ended(*first)}; ranks {alive} still run after {grace_s:.0f} s: terminating them")
                self.send(signal.SIGTERM)
                termed_at = now
            if termed_at is not None and now - termed_at > 10:
                self.send(signal.SIGKILL)
            time.sleep(0.1)
        for t in self.threads:
            t.join(timeout=5)
        for log in self.logs:
            if log is not None:
                log.close()
        if first is None:
            return 0
        if len(self.procs) > 1 and first[1] not in (2, 3, 4, 5, 75):  # the known ones said why on rank 0 already
            self._say(f"{_ended(*first)} (its output above"
                      + (", and its log file" if self.logs[0] is not None else "") + ")")
        return first[1]

    def _say(self, msg: str) -> None:
        with self.lock:
            try:
                print(f"[launch] {msg}", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # (no console left to tell: the ranks' statuses still come out)
                pass


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m longstraw_mcore.launcher --nproc N [options] -- SUBCOMMAND [ARGS ...]",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m longstraw_mcore.launcher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (where rank 0 listens)")
    p.add_argument("--master-port", type=int, default=None, help="default: a free port (one node only)")
    p.add_argument("--log-dir", default=None, help="per-rank logs under DIR/node<R>/rank<global>.log")
    p.add_argument("--grace", type=float, default=float(os.environ.get("LONGSTRAW_FAIL_GRACE_S", "30")),
                   help="seconds the other ranks get after one fails (LONGSTRAW_FAIL_GRACE_S)")
    a = p.parse_args(argv[:cut])
    entry = argv[cut + 1:]
    for name, v, low in (("--nproc", a.nproc, 1), ("--nnodes", a.nnodes, 1), ("--node-rank", a.node_rank, 0)):
        if v < low:
            print(f"error: {name} {v}: must be >= {low}", file=sys.stderr)
            return 2
    if a.node_rank >= a.nnodes:
        print(f"error: --node-rank {a.node_rank} is outside --nnodes {a.nnodes}", file=sys.stderr)
        return 2
    if not entry:
        print("error: give the longstraw subcommand after --", file=sys.stderr)
        return 2
    if a.master_port is None and a.nnodes > 1:
        print("error: --master-port is needed with --nnodes > 1 (every node must use the same one)", file=sys.stderr)
        return 2
    held = None
    if a.master_port is None:  # (held until the ranks end: rank 0's store binds beside it; launch_local.py)
        from longstraw_mcore.launch_local import reserve_port

        held = reserve_port()
    port = a.master_port if held is None else held.getsockname()[1]
    try:
        ranks = Ranks([sys.executable, "-m", "longstraw_mcore", *entry], a.nproc, a.nnodes, a.node_rank,
                      a.master_addr, port, a.log_dir)
        for sig in FORWARDED:
            signal.signal(sig, lambda s, f: ranks.send(s))
        return ranks.wait(a.grace)
    finally:
        if held is not None:
            held.close()


if __name__ == "__main__":
    sys.exit(main())
