"""Start longstraw from an MPI launcher (`mpirun`, `srun --mpi=pmix`) instead of torchrun.

  mpirun -np 8 python -m longstraw_mcore.launch_mpi validate --config ... parallel.tp=2
  srun --mpi=pmix --ntasks-per-node=8 python -m longstraw_mcore.launch_mpi train --config ...

MPI gives every process its rank and the world size; the processes on one host (MPI's shared-memory
split) give the local rank. Rank 0 picks the rendezvous address (127.0.0.1 when every rank is on its
host, else its host name; MASTER_ADDR / MASTER_PORT in the environment win) and a free port, and
broadcasts them. The torch.distributed environment variables are then set exactly as torchrun sets
them and the normal entry point (`longstraw_mcore.cli.main`) runs; MPI itself carries no training
traffic (gloo or NCCL do).
"""

from __future__ import annotations

import os
import socket
import sys

_held = None
"""Rank 0's hold on the rendezvous port (launch_local.reserve_port) until its store binds it."""


def torch_env(rank: int, world_size: int, local_rank: int, local_world_size: int, hosts: list[str],
              port: int, environ: dict[str, str]) -> dict[str, str]:
    """The torchrun-style variables for one rank. `hosts`: every rank's host name in rank order;
    `port`: rank 0's free port (used unless MASTER_PORT is set)."""
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size and len(hosts) == world_size):
        raise ValueError(f"inconsistent MPI layout: rank {rank} of {world_size}, local rank {local_rank} of "
                         f"{local_world_size}, {len(hosts)} host names")
    addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size), "MASTER_ADDR": addr,
            "MASTER_PORT": environ.get("MASTER_PORT") or str(port)}


def _mpi_env() -> dict[str, str]:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise SystemExit(f"error: the MPI bootstrap needs mpi4py ({e}); install the project's `mpi` extra "
                         "(pip install mpi4py) against the site's MPI") from e
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    hosts = world.allgather(socket.gethostname())
    port = 0
    if world.Get_rank() == 0:
        from longstraw_mcore.launch_local import reserve_port

        global _held
        _held = reserve_port()  # (for this process's life: its own store binds beside it, after its imports)
        port = _held.getsockname()[1]
    port = world.bcast(port, root=0)
    env = torch_env(world.Get_rank(), world.Get_size(), local.Get_rank(), local.Get_size(), hosts, port,
                    dict(os.environ))
    local.Free()
    return env


def main(argv=None) -> int:
    env = _mpi_env()
    os.environ.update(env)
    if env["RANK"] == "0":
        print(f"[mpi] {env['WORLD_SIZE']} rank(s), {env['LOCAL_WORLD_SIZE']} per host, rendezvous "
              f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", file=sys.stderr, flush=True)
    from longstraw_mcore.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":  # guarded: Megatron's checkpoint writer re-imports __main__
    sys.exit(main())
