"""FLOP counting for the benches: torch's FlopCounterMode, with formulas for the CUDA flash-attention ops
that accept grouped-query shapes.

torch's own formulas for `aten._flash_attention_forward/_backward` assert that query, key and value
have the same head count (`sdpa_flop_count: query/key/value shapes are incompatible`, seen on an H200
with torch 2.11), while ops/flash_attention.py calls the op with fewer KV heads than query heads (the
op supports that natively). These count the same products as torch's formulas, per query head:
forward 2*B*Hq*T*S*(D + Dv) (scores and output), backward 2*B*Hq*T*S*(3*D + 2*Dv) (scores recomputed,
dP, dV, dQ, dK); like torch's, they ignore the causal mask. Layouts are the op's: [B, T, H, D].
"""

from __future__ import annotations

import torch


def _flash_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    B, T, H, D = query
    S, Dv = key[1], value[3]
    return 2 * B * H * T * S * (D + Dv)


def _flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    B, T, H, D = query
    S, Dv = key[1], value[3]
    return 2 * B * H * T * S * (3 * D + 2 * Dv)


def flop_counter():
    """A FlopCounterMode (no display) that also counts grouped-query flash attention on CUDA."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={aten._flash_attention_forward: _flash_forward,
                                                          aten._flash_attention_backward: _flash_backward})
