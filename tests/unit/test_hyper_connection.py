"""GLM-5.3-Flash's hyper-connection streams (models/hyper_connection.py) equal transformers' in float64, its float32
casts lifted (tests/hf_reference.py `LiftFloat32ToFloat64`): `Glm5NextTextHyperConnection` (post, comb, the
collapsed input) and the decoder layer's mixing of a sublayer's output into the streams (modeling_glm5_next's
`hidden_states = post * out + comb^T @ residual`), for N = 4 streams of width 16 with 20 Sinkhorn iterations,
N = 3 with 3 and N = 2 with 1 (only the first column normalisation); outputs and the gradients of fn, base, scale, the
streams and the sublayer output (a fixed random functional of the mixed streams), <= 1e-12 relative. Also: comb
is doubly stochastic after 20 iterations (rows and columns sum to 1 within 1e-5: the eps terms), and `head` of
`expand` is the identity."""

from __future__ import annotations

import torch
from layout_compare import rel as _rel

from longstraw_mcore.bench.hf_kernels import glm5_next_modeling
from longstraw_mcore.models.hyper_connection import HyperConnection, expand, head, mix

F64 = torch.float64


def _case(n: int, iters: int, seed: int):
    from hf_reference import LiftFloat32ToFloat64

    hf = glm5_next_modeling(fla=False)
    H, T, B = 16, 5, 3
    gen = torch.Generator().manual_seed(seed)
    with LiftFloat32ToFloat64():
        cfg = hf.Glm5NextTextConfig(hidden_size=H, hc_mult=n, hc_sinkhorn_iters=iters, rms_norm_eps=1e-5)
        ref = hf.Glm5NextTextHyperConnection(cfg).to(F64)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=gen)
    ours = HyperConnection(H, n, iters, cfg.hc_eps, cfg.rms_norm_eps, dtype=F64)
    ours.load_state_dict(ref.state_dict())
    streams = torch.randn(B, T, n, H, generator=gen, dtype=F64)  # transformers' [B, T, N, H]
    out = torch.randn(B, T, H, generator=gen, dtype=F64)
    w = torch.randn(B, T, n, H, generator=gen, dtype=F64)

    def run(module, lifted):
        module.zero_grad(set_to_none=True)
        s, o = streams.clone().requires_grad_(True), out.clone().requires_grad_(True)
        if lifted:
            with LiftFloat32ToFloat64():
                post, comb, y = module(s)
                mixed = post.to(F64).unsqueeze(-1) * o.unsqueeze(-2) + torch.matmul(comb.to(F64).transpose(-1, -2), s)
        else:
            post, comb, y = module(s)
            mixed = mix(s, o, post, comb)
        ((mixed * w).sum() + (y * w[:, :, 0]).sum()).backward()
        grads = {k: p.grad for k, p in module.named_parameters()} | {"streams": s.grad, "out": o.grad}
        return (post, comb, y, mixed), grads

    return run(ref, True), run(ours, False)


def test_streams_equal_transformers():
    for n, iters, seed in ((4, 20, 0), (3, 3, 2), (2, 1, 1)):  # (20 iterations converge: 3 tell each one apart)
        (want, gw), (got, gg) = _case(n, iters, seed)
        for name, a, b in zip(("post", "comb", "collapsed", "mixed"), got, want):
            assert a.shape == b.shape and _rel(a, b) <= 1e-12, (n, name, _rel(a, b))
        assert set(gg) == set(gw) == {"fn", "base", "scale", "streams", "out"}
        for k in gw:
            assert _rel(gg[k], gw[k]) <= 1e-12 and float(gw[k].abs().max()) > 0, (n, k, _rel(gg[k], gw[k]))
        if iters == 20:
            comb = got[1]
            # (each division's + eps leaves a sum short of 1 by about eps, and the + eps on every entry adds N eps)
            assert float((comb.sum(-1) - 1).abs().max()) < 1e-5 and float((comb.sum(-2) - 1).abs().max()) < 1e-5
    x = torch.randn(3, 2, 16, dtype=F64)
    assert torch.equal(head(expand(x, 4)), x)
