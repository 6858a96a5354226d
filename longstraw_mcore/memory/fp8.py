"""Prompt state stored as float8 e4m3 with a float32 scale per block of 128 values (memory.state_dtype=fp8).

A state tensor [B, N, ...] (N positions) is kept as rows of its trailing values: each row is padded to
a multiple of 128, split into blocks of 128, and every block stored as e4m3 values times its own
float32 scale (the block's largest magnitude / 448, e4m3's largest normal). Bytes per row:
ceil(v / 128) x (128 + 4) for v values (1.031 bytes per value when v is a multiple of 128). Rows are
independent, so a capture chunk writes its rows without touching the others. Torch's own float8
dtype; no library (measured: 0.026 relative error on Gaussian data, ../shared/notes/turn3-facts.md)."""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def fp8_nbytes(rows: int, values_per_row: int) -> int:
    """Bytes of `rows` rows of `values_per_row` values stored as fp8 blocks (values + scales)."""
    blocks = -(-values_per_row // BLOCK)
    return rows * blocks * (BLOCK + 4)


class Fp8Rows:
    """A [B, N, *rest] tensor kept as fp8 blocks; `dequantize()` gives it back in `dtype`."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device, pin: bool = False):
        self.shape, self.dtype = tuple(shape), dtype
        self.values = 1
        for d in shape[2:]:
            self.values *= d
        self.blocks = -(-self.values // BLOCK)
        kw = {"device": device, "pin_memory": pin}
        self.q = torch.zeros(shape[0], shape[1], self.blocks, BLOCK, dtype=torch.float8_e4m3fn, **kw)
        self.scale = torch.zeros(shape[0], shape[1], self.blocks, dtype=torch.float32, **kw)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]

    def write(self, lo: int, x: torch.Tensor) -> None:
        """Rows [lo, lo + x.shape[1]) from `x` ([B, n, *rest])."""
        B, n = x.shape[:2]
        flat = x.detach().reshape(B, n, self.values).to(torch.float32)
        if self.blocks * BLOCK != self.values:
            flat = torch.nn.functional.pad(flat, (0, self.blocks * BLOCK - self.values))
        flat = flat.view(B, n, self.blocks, BLOCK)
        amax = flat.abs().amax(-1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        q = (flat / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        self.q[:, lo:lo + n].copy_(q, non_blocking=True)
        self.scale[:, lo:lo + n].copy_(scale, non_blocking=True)

    def dequantize(self, device, rows: int | None = None) -> torch.Tensor:
        """The first `rows` rows (all by default) in `dtype` on `device`."""
        rows = self.shape[1] if rows is None else rows
        q = self.q[:, :rows].to(device, non_blocking=True)
        s = self.scale[:, :rows].to(device, non_blocking=True)
        x = (q.to(torch.float32) * s.unsqueeze(-1)).reshape(self.shape[0], rows, self.blocks * BLOCK)
        return x[..., :self.values].to(self.dtype).reshape(self.shape[0], rows, *self.shape[2:])
