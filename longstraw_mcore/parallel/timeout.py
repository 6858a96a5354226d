"""How long a collective may wait for its peers before the job ends (cli.py prints the rank and the call)."""

from __future__ import annotations

import os


def dist_timeout():
    """Every collective's timeout, of the world group and of every group made after it (Megatron's and
    this package's: a group made without one gets torch's default, not the world's): LONGSTRAW_DIST_TIMEOUT_S
    (launch/slurm.sbatch sets it), or None for torch's defaults (10 min NCCL, 30 min gloo)."""
    timeout = os.environ.get("LONGSTRAW_DIST_TIMEOUT_S")
    if timeout is None:
        return None
    if not (timeout.isdigit() and int(timeout) > 0):
        raise ValueError(f"LONGSTRAW_DIST_TIMEOUT_S={timeout!r}: must be a positive number of seconds")
    from datetime import timedelta

    return timedelta(seconds=int(timeout))
