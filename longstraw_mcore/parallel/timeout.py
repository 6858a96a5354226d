"""How long a collective may wait for its peers before the job ends (cli.py prints the rank and the call), and
how long start-up may wait for the rendezvous store."""

from __future__ import annotations

import os
from datetime import timedelta


def dist_timeout():
    """Every collective's timeout, of the world group and of every group made after it (Megatron's and
    this package's: a group made without one gets torch's default, not the world's): LONGSTRAW_DIST_TIMEOUT_S
    (launch/slurm.sbatch sets it), or None for torch's defaults (10 min NCCL, 30 min gloo)."""
    timeout = os.environ.get("LONGSTRAW_DIST_TIMEOUT_S")
    if timeout is None:
        return None
    if not (timeout.isdigit() and int(timeout) > 0):
        raise ValueError(f"LONGSTRAW_DIST_TIMEOUT_S={timeout!r}: must be a positive number of seconds")
    return timedelta(seconds=int(timeout))


def rendezvous_timeout(backend: str) -> timedelta:
    """How long `init_process_group`'s env:// rendezvous waits for the store and its peers: the timeout it is
    given (`dist_timeout()`), else torch's default for the backend. Every other start-up connection to the
    store (parallel/peers.py's heartbeat) waits as long: a rank that reached the rendezvous in time must not
    fail on a second connection because hundreds of ranks (or a loaded machine) slow the store down."""
    given = dist_timeout()
    if given is not None:
        return given
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    return nccl if backend == "nccl" and nccl is not None else constants.default_pg_timeout
