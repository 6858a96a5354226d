"""flash-linear-attention behind ops/fla_gdn.py equals the plain chunked rule on a CUDA device: bf16
inputs, float32 states, outputs / final state / every gradient including the initial state's within
2e-2 of each tensor's largest entry (Qwen3.6-27B head shapes: 16 key heads of 128, 48 value heads).
Skipped without a GPU or without fla (the gpu extra); run by scripts/gpu_check.sh."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                                reason="needs a CUDA device and flash-linear-attention")


def test_fla_equals_the_plain_rule_bf16():
    from longstraw_mcore.ops import fla_gdn, gated_delta

    g0 = torch.Generator().manual_seed(0)
    B, T, h, r, K, V = 1, 300, 16, 3, 128, 128
    base = dict(q=torch.randn(B, T, h, K, generator=g0), k=torch.randn(B, T, h, K, generator=g0),
                v=torch.randn(B, T, h * r, V, generator=g0), g=-torch.rand(B, T, h * r, generator=g0) * 0.1,
                beta=torch.rand(B, T, h * r, generator=g0), s0=torch.randn(B, h * r, K, V, generator=g0) * 0.1)
    res = {}
    for name, mod in (("plain", gated_delta), ("fla", fla_gdn)):
        t = {n: (x.cuda().bfloat16() if n in ("q", "k", "v") else x.cuda()).requires_grad_() for n, x in base.items()}
        o, s = mod.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], t["s0"], chunk_size=64)
        (o.float().pow(2).sum() + s.pow(2).sum()).backward()
        res[name] = [o, s, *(t[n].grad for n in base)]
    for a, b in zip(res["fla"], res["plain"]):
        a, b = a.float().cpu(), b.float().cpu()
        assert float((a - b).abs().max()) <= 2e-2 * float(b.abs().max())
