"""The benches' flash-attention FLOP formulas (bench/flops.py) against torch's own where torch's apply
(equal head counts), and grouped-query shapes counted as the same products per query head."""

import torch
from torch.utils.flop_counter import flop_registry

from longstraw_mcore.bench.flops import _flash_backward, _flash_forward


def test_flash_formulas_equal_torch_and_count_grouped_queries():
    aten = torch.ops.aten
    B, T, S, H, D, Dv = 2, 24, 40, 4, 16, 8
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    q, k, v, o, do = meta(B, T, H, D), meta(B, S, H, D), meta(B, S, H, Dv), meta(B, T, H, Dv), meta(B, T, H, Dv)
    lse = meta(B, H, T)
    fwd = flop_registry[aten._flash_attention_forward](q, k, v, None, None, T, S, 0.0, False, False,
                                                        out_val=(o, lse))
    bwd = flop_registry[aten._flash_attention_backward](do, q, k, v, o, lse, None, None, T, S, 0.0, False,
                                                         None, None, out_val=(q, k, v))
    shapes = [tuple(x.shape) for x in (q, k, v)]
    assert _flash_forward(*shapes) == fwd == 2 * B * H * T * S * (D + Dv)
    assert _flash_backward(tuple(do.shape), *shapes) == bwd
    # 2 KV heads for 4 query heads: the same products per query head
    kg, vg = (B, S, 2, D), (B, S, 2, Dv)
    assert _flash_forward(shapes[0], kg, vg) == fwd and _flash_backward(tuple(do.shape), shapes[0], kg, vg) == bwd
