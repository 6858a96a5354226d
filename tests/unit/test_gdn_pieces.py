"""The gated delta rule's affine piece maps (ops/gdn_pieces.py) against the rule over the whole sequence
(ops/gated_delta.py's chunked form, itself held to the token-by-token recurrence in test_ops.py):
a sequence cut into uneven pieces (shorter than a chunk, empty, longer than several chunks), each
mapped from an unknown entering state and combined by the scan, gives the same outputs and final
state in float64 (<= 1e-12), and the same gradients of q, k, v, g, beta and the entering state."""

from __future__ import annotations

import torch

from longstraw_mcore.ops.gated_delta import chunk_gated_delta_rule
from longstraw_mcore.ops.gdn_pieces import piece_maps, scan


def _inputs(T, h=2, r=2, K=8, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = h * r
    x = [torch.randn(2, T, h, K, generator=g, dtype=torch.float64),
         torch.randn(2, T, h, K, generator=g, dtype=torch.float64),
         torch.randn(2, T, H, V, generator=g, dtype=torch.float64),
         -torch.rand(2, T, H, generator=g, dtype=torch.float64) * 0.5,
         torch.rand(2, T, H, generator=g, dtype=torch.float64)]
    S0 = torch.randn(2, H, K, V, generator=g, dtype=torch.float64) * 0.3
    return [t.requires_grad_(True) for t in x], S0.requires_grad_(True)


def _pieced(x, S0, cuts, C):
    maps = [piece_maps(*(t[:, a:b] for t in x), chunk_size=C, state_dtype=torch.float64)
            for a, b in zip(cuts[:-1], cuts[1:])]
    entering, S = scan(maps, S0)
    return torch.cat([m.output(s) for m, s in zip(maps, entering)], 1), S


def test_pieces_combined_by_the_scan_equal_the_whole_sequence():
    T, C = 53, 8
    for cuts in ([0, 53], [0, 3, 3, 20, 41, 53], [0, 1, 2, 30, 52, 53], [0, 26, 53]):
        x, S0 = _inputs(T)
        want_o, want_S = chunk_gated_delta_rule(*x, S0, chunk_size=C, state_dtype=torch.float64)
        got_o, got_S = _pieced(x, S0, cuts, C)
        assert (got_o - want_o).abs().max() <= 1e-12, cuts
        assert (got_S - want_S).abs().max() <= 1e-12, cuts
        up_o = torch.randn(want_o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        up_S = torch.randn(want_S.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        want = torch.autograd.grad((want_o * up_o).sum() + (want_S * up_S).sum(), [*x, S0])
        got = torch.autograd.grad((got_o * up_o).sum() + (got_S * up_S).sum(), [*x, S0])
        for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), got, want):
            assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.abs().max())), (cuts, name)
