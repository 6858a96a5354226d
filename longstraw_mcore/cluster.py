"""What a cluster launch computes, as plain functions (tested with a simulated Slurm environment and a
real one-node Slurm): the node list, the head node, ranks per node (and where that number came from),
the master port, and the launcher command each node runs.

  python -m longstraw_mcore.cluster launch-args [--port P] [--log-dir DIR] [--python PY] -- SUBCOMMAND ARGS...
  python -m longstraw_mcore.cluster describe

`launch-args` prints, for this node of the Slurm allocation, the command line (shell-quoted) of
longstraw_mcore/launcher.py that starts this node's ranks of `SUBCOMMAND ARGS...`, every node meeting at
the first node of the allocation; launch/slurm.sbatch runs it once per node (`srun --ntasks-per-node=1`).
Ranks per node: LONGSTRAW_PROCS_PER_NODE if set (CPU runs), else the GPUs Slurm gave the node
(SLURM_GPUS_ON_NODE, or SLURM_GPUS_PER_NODE such as "h100:8"), else SLURM_NTASKS_PER_NODE (said so:
on CPU that is usually 1). The master port: --port, else derived from the job id (job_port), so two
jobs sharing a node do not meet at the same port (a fixed 29500 made the second join the first's store).
`describe` prints the allocation in one line (what slurm.sbatch shows before it starts).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass


class LaunchError(ValueError):
    """The environment does not describe a launch this module can make; the message says what is missing."""


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's compressed host list -> host names: "gpu[01-03,07],login1" -> gpu01, gpu02, gpu03, gpu07,
    login1 (zero padding kept; several bracket groups in one name expand as a product)."""
    hosts, i, depth, start = [], 0, 0, 0
    parts = []
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    for part in filter(None, (p.strip() for p in parts)):
        names = [""]
        for text, ranges in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            names = [n + text for n in names]
            if ranges:
                options = []
                for r in ranges.split(","):
                    if "-" in r:
                        a, b = r.split("-", 1)
                        if not (a.isdigit() and b.isdigit()) or int(b) < int(a):
                            raise LaunchError(f"host list {spec!r}: bad range {r!r}")
                        options += [str(k).zfill(len(a)) for k in range(int(a), int(b) + 1)]
                    elif r.isdigit():
                        options.append(r)
                    else:
                        raise LaunchError(f"host list {spec!r}: bad range {r!r}")
                names = [n + o for n in names for o in options]
        hosts += names
    if not hosts:
        raise LaunchError(f"host list {spec!r} names no host")
    return hosts


@dataclass(frozen=True)
class Allocation:
    hosts: list
    node_rank: int
    procs_per_node: int
    job_id: str
    procs_from: str = ""
    """The environment variable the ranks per node came from."""

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.procs_per_node


def _count(value: str) -> int:
    """"8", "h100:8", "8(x2)" -> 8."""
    m = re.search(r"(\d+)(?:\(x\d+\))?$", value.strip())
    if not m:
        raise LaunchError(f"cannot read a count from {value!r}")
    return int(m.group(1))


def slurm_allocation(env: dict) -> Allocation:
    """This node's view of the Slurm allocation (from `env`, e.g. os.environ)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set: run inside a Slurm allocation (sbatch / salloc)")
    hosts = expand_nodelist(nodelist)
    if "SLURM_NNODES" in env and int(env["SLURM_NNODES"]) != len(hosts):
        raise LaunchError(f"SLURM_NNODES={env['SLURM_NNODES']} but the node list {nodelist!r} has {len(hosts)} hosts")
    node = int(env.get("SLURM_NODEID", "0"))
    if not 0 <= node < len(hosts):
        raise LaunchError(f"SLURM_NODEID={node} is outside the {len(hosts)} nodes")
    for key in ("LONGSTRAW_PROCS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if env.get(key):
            per = _count(env[key])
            break
    else:
        raise LaunchError("ranks per node unknown: request GPUs (--gpus-per-node) or set LONGSTRAW_PROCS_PER_NODE")
    if per < 1:
        raise LaunchError(f"ranks per node {per}: must be >= 1")
    return Allocation(hosts=hosts, node_rank=node, procs_per_node=per, job_id=env.get("SLURM_JOB_ID", "0"),
                      procs_from=key)


PORT_BASE, PORT_SPAN = 20000, 12000
"""Derived master ports lie in [20000, 32000): below Linux's ephemeral range (32768-60999), so a port
some connection picked at random is not in the way."""


def job_port(job_id: str) -> int:
    """The master port of a job: PORT_BASE + job id mod PORT_SPAN (jobs sharing a node differ unless their
    ids differ by a multiple of 12,000)."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def launcher_argv(a: Allocation, entry: list[str], python: str = sys.executable, port: int | None = None,
                  log_dir: str | None = None) -> list[str]:
    """The command this node runs: longstraw_mcore/launcher.py with this node's ranks, meeting at the head."""
    argv = [python, "-m", "longstraw_mcore.launcher", "--nproc", str(a.procs_per_node), "--nnodes", str(len(a.hosts)),
            "--node-rank", str(a.node_rank), "--master-addr", a.head,
            "--master-port", str(job_port(a.job_id) if port is None else port)]
    if log_dir:  # one file per rank under log_dir/node<R>/, and on the console with the global rank
        argv += ["--log-dir", log_dir]
    return argv + ["--", *entry]


def describe(a: Allocation, port: int | None = None) -> str:
    note = (" (no GPUs requested: for a CPU run set LONGSTRAW_PROCS_PER_NODE)"
            if a.procs_from == "SLURM_NTASKS_PER_NODE" else "")
    return (f"{len(a.hosts)} node(s) {','.join(a.hosts[:4])}{',...' if len(a.hosts) > 4 else ''}, "
            f"{a.procs_per_node} rank(s) per node from {a.procs_from}{note}, {a.world_size} rank(s), master "
            f"{a.head}:{job_port(a.job_id) if port is None else port}")


def main(argv=None) -> int:
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m longstraw_mcore.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["launch-args", "world-size", "describe"])
    p.add_argument("--port", type=int, default=None, help="master port (default: derived from the job id)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--python", default=sys.executable)
    argv = list(sys.argv[1:] if argv is None else argv)
    entry = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        alloc = slurm_allocation(dict(os.environ))
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.what == "world-size":
        print(alloc.world_size)
        return 0
    if a.what == "describe":
        print(describe(alloc, a.port))
        return 0
    if not entry:
        print("error: give the longstraw subcommand after --", file=sys.stderr)
        return 2
    print(shlex.join(launcher_argv(alloc, entry, a.python, a.port, a.log_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
