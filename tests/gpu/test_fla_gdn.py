"""flash-linear-attention behind ops/fla_gdn.py equals the plain twins on a CUDA device, at Qwen3.6-27B's
Gated DeltaNet head shapes (16 key heads of 128, 48 value heads of 128): the rule with an initial state
and a gradient entering through the final state (exact mode), the causal conv with a window in and out;
outputs, states and every gradient, the state gradients included, each within a tolerance of its own
largest entry: bf16 inputs 2e-2 (fla's products take bf16 operands, the twin's float32 ones), float32
inputs 5e-3 (Triton's float32 dots run as TF32 on Hopper by default). This is the decisive check of fla's
backward on the device (fla issue #640 was a Hopper-only miscompile the CPU interpreter cannot see).
Skipped without a GPU or without fla; run by scripts/gpu_check.sh."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                                reason="needs a CUDA device and flash-linear-attention (fla-core)")
TOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _both(fn, base: dict, dtype) -> dict:
    from longstraw_mcore.ops import fla_gdn, gated_delta

    res = {}
    for name, mod in (("fla", fla_gdn), ("plain", gated_delta)):
        t = {n: (x.cuda().to(dtype) if n in ("q", "k", "v", "x", "w") else x.cuda()).clone().requires_grad_()
             for n, x in base.items()}
        outs = fn(mod, **t)
        gen = torch.Generator(device="cuda").manual_seed(3)
        sum((o.float() * torch.randn(o.shape, generator=gen, device="cuda")).sum() for o in outs).backward()
        res[name] = {**{f"out{i}": o for i, o in enumerate(outs)}, **{f"d_{n}": x.grad for n, x in t.items()}}
    return {k: _rel(res["fla"][k], res["plain"][k]) for k in res["plain"]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_rule_and_conv_equal_the_twins(dtype):
    g0 = torch.Generator().manual_seed(0)
    B, T, h, r, K, V = 2, 300, 16, 3, 128, 128
    rule = dict(q=torch.randn(B, T, h, K, generator=g0), k=torch.randn(B, T, h, K, generator=g0),
                v=torch.randn(B, T, h * r, V, generator=g0), g=-torch.rand(B, T, h * r, generator=g0) * 0.1,
                beta=torch.rand(B, T, h * r, generator=g0), s0=torch.randn(B, h * r, K, V, generator=g0) * 0.1)
    errs = _both(lambda mod, q, k, v, g, beta, s0: mod.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=64),
                 rule, dtype)
    ch = 2 * h * K + h * r * V
    conv = dict(x=torch.randn(B, T, ch, generator=g0), w=torch.randn(ch, 4, generator=g0) * 0.5,
                s0=torch.randn(B, ch, 3, generator=g0))
    errs.update({f"conv_{k}": v for k, v in _both(lambda mod, x, w, s0: mod.causal_conv1d(x, w, s0, activation="silu"),
                                                  conv, dtype).items()})
    print({k: f"{v:.1e}" for k, v in errs.items()})
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, f"fla vs twin ({dtype}) beyond {TOL[dtype]}: {bad}"
