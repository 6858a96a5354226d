"""memory.host_heap: what glibc does with freed host memory in this process.

    system   glibc's default. A block above its mmap threshold (at most 32 MiB, dynamic) is its own
             mapping, returned to the OS when freed, and the next step's tensor of that size faults its
             pages in again (the kernel zeroes each 4 KiB page). The heap's top is trimmed back likewise.
    retain   no mappings of their own and no trimming (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD at its
             largest): freed blocks stay in the heap for the next allocation, the CPU counterpart of CUDA's
             caching allocator. Resident memory stays at the step's high-water mark (live tensors plus
             the heap's fragmentation); a steady training loop then touches no new pages.

Measured on this project's 2-core CPU machine (tools/bench_replay.py --vs-transformers, P=16,384): exact
mode's capture keeps its graph (GiBs of saved tensors) and under `system` faulted 177,000 pages in a
warm step (1.7 million in the first), 5.7-7.5 s against detached's 5.1-5.3 s for the same forward;
under `retain`, tens of faults in a warm step and 5.1 s. Process-wide and one-way (glibc cannot be put
back on its dynamic threshold), so the benchmarks that measure resident memory refuse it. glibc only:
elsewhere `retain` is an error."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
_applied: str | None = None


def libc():
    """This process's C library when it has glibc's mallopt (tools/bench_replay.py sets its own
    threshold for the peak-memory columns and trims), else None."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        return lib if hasattr(lib, "mallopt") else None
    except OSError:
        return None


def apply(policy: str) -> None:
    """Set this process's host heap policy (`system` leaves glibc as it is). Idempotent."""
    global _applied
    if policy == "system" or policy == _applied:
        return
    if policy != "retain":
        raise ValueError(f"memory.host_heap={policy!r}: must be one of ('system', 'retain')")
    lib = libc()
    if lib is None:
        raise RuntimeError("memory.host_heap=retain needs glibc's mallopt, which this process's C library "
                           "lacks; use memory.host_heap=system")
    # largest trim threshold mallopt takes: a C int
    ok = lib.mallopt(M_MMAP_MAX, 0) == 1 and lib.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        raise RuntimeError("memory.host_heap=retain: glibc refused mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD); "
                           "use memory.host_heap=system")
    _applied = policy


def applied() -> str:
    """The policy this process runs under."""
    return _applied or "system"
