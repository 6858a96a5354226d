"""What the DSA kernels' launchers share (ops/dsa_triton_indexer.py, ops/dsa_triton_mla.py): block sizes
rounded to a power of two, and key / latent tensors read in place, a tensor or one part of a (head,
tail) pair of its rows (ops/dsa.py), whose batch of 1 serves every batch row of the queries."""

from __future__ import annotations

import triton


def pow2(n: int, at_least: int = 16) -> int:
    """n rounded up to a power of two, at least `at_least` (tl.dot needs dims >= 16)."""
    return max(at_least, triton.next_power_of_2(n))


def in_place(x):
    """`x` as the kernels read it: where it lies, only its last dim made contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


def row_strides(x) -> tuple[int, int]:
    """(batch, row) strides of `x` [B, S, D]; a batch of 1 (the prompt state's) has batch stride 0, so every
    batch row of the queries reads (and a gradient buffer of that shape sums into) the same rows."""
    return (0 if x.shape[0] == 1 else x.stride(0)), x.stride(1)
