"""What a cluster launch computes, as plain functions (tested with a simulated Slurm environment): the
node list, the head node, ranks per node, and the `torchrun` command each node runs.

  python -m longstraw_mcore.cluster torchrun-args [--port P] [--log-dir DIR] -- SUBCOMMAND ARGS...

prints, for this node of the Slurm allocation, the command line (shell-quoted) that runs
`python -m longstraw_mcore SUBCOMMAND ARGS...` under torchrun with c10d rendezvous on the first node
of the allocation. launch/slurm.sbatch runs it once per node (`srun --ntasks-per-node=1`).
Ranks per node: LONGSTRAW_PROCS_PER_NODE if set (CPU runs), else the GPUs Slurm gave the node
(SLURM_GPUS_ON_NODE, or SLURM_GPUS_PER_NODE such as "h100:8"), else SLURM_NTASKS_PER_NODE.
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
    return Allocation(hosts=hosts, node_rank=node, procs_per_node=per, job_id=env.get("SLURM_JOB_ID", "0"))


def torchrun_argv(a: Allocation, entry: list[str], python: str = sys.executable, port: int = 29500,
                  log_dir: str | None = None) -> list[str]:
    """The command this node runs: torchrun with c10d rendezvous at the head node, then the entry point."""
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(len(a.hosts)), "--node-rank", str(a.node_rank),
            "--nproc-per-node", str(a.procs_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{a.head}:{port}", "--rdzv-id", str(a.job_id)]
    if log_dir:  # one stdout/stderr file per rank under log_dir, and on the console
        argv += ["--log-dir", log_dir, "--redirects", "3", "--tee", "3"]
    return argv + ["-m", "longstraw_mcore", *entry]


def main(argv=None) -> int:
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m longstraw_mcore.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["torchrun-args", "world-size"])
    p.add_argument("--port", type=int, default=29500)
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
    if not entry:
        print("error: give the longstraw subcommand after --", file=sys.stderr)
        return 2
    log_dir = os.path.join(a.log_dir, f"node{alloc.node_rank}") if a.log_dir else None
    print(shlex.join(torchrun_argv(alloc, entry, a.python, a.port, log_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
