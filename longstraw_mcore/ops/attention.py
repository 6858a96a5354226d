"""Partial RoPE, and the plain-torch reference twin of blockwise attention (block_attention.py).

`cached_causal_attention` materialises the full score matrix against concatenated keys: simple and
obviously right, it is what the blockwise kernel is tested against (tests/unit/test_block_attention.py).

Legend: B batch, T new tokens, P cached (earlier) positions, Hq query heads, Hk key/value heads,
D head dim. New token i sits at absolute position P + i and attends cached positions 0..P-1 and new
positions 0..i. Scores and softmax run in at least float32 (float64 under float64).
"""

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


def cached_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """q [B,T,Hq,D], k/v [B,T,Hk,D], past_k/v [B,P,Hk,D] or None -> out [B,T,Hq,D] (q.dtype)."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    if past_k is not None:
        k = torch.cat([past_k.to(k.dtype), k], dim=1)
        v = torch.cat([past_v.to(v.dtype), v], dim=1)
    P = k.shape[1] - T
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = Hq // Hk
    qh = q.to(work).transpose(1, 2)                                           # [B,Hq,T,D]
    kh = k.to(work).transpose(1, 2).repeat_interleave(rep, dim=1)             # [B,Hq,P+T,D]
    vh = v.to(work).transpose(1, 2).repeat_interleave(rep, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(P + T, device=q.device)[None, :]
    scores = scores.masked_fill(j > i + P, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vh).transpose(1, 2).to(q.dtype)
