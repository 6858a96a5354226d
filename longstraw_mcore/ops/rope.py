"""Partial rotary position embedding (Qwen3.5/3.6: the first `rotary_dim` of `head_dim` dims rotated,
half-split layout as `rotate_half`; the rest passed through).

Legend: T tokens, B batch, H heads, D head dim. Angles in float32 (float64 under float64)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, rotary_dim] for integer `positions` [T] (half-split layout, as `rotate_half`)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=work, device=positions.device) / rotary_dim))
    freqs = positions.to(work)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of x [B, T, H, D] (cos/sin [T, rotary_dim]); pass the rest."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)
