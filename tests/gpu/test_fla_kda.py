"""flash-linear-attention's Kimi Delta Attention behind ops/fla_kda.py equals the plain twin (ops/kda.py) on a
CUDA device at GLM-5.3-Flash's head dims (K = V = 128; 4 heads: the head count only widens the grid): GLM's
bounded gate (lower -5) at its initial decay rates (e^{A_log} in [1, 16], dt_bias 1: most steps decay by e^-4
to e^-5) through fla's bounded-gate path (`kda_kernel(v, lower_bound=-5)`, safe_gate: what the checkpoints'
config names) and its general path (the layer's call without a bound), with an initial state and a
gradient entering through the final state; and the sequence-parallel piece maps (values K + V = 256 wide,
float32, entered with [I | 0]). Outputs, states and every gradient, the initial state's included, each within
a tolerance of its own largest entry: bf16 inputs 2e-2 (fla's products take bf16 operands, the twin's float32
ones), float32 inputs 5e-3 (Triton's float32 dots run as TF32 by default), as tests/gpu/test_fla_gdn.py.
The CPU interpreter holds the same code to 1e-5 in float32 (tests/unit/test_fla_interpreter.py); only a
device run sees a GPU miscompile. Each case's first fla call compiles and autotunes fla's kernels: printed
apart from the second. Skipped without a GPU or without fla; run by `scripts/gpu_check.sh --kda`."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                                reason="needs a CUDA device and flash-linear-attention (fla-core)")
TOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(B=2, T=300, H=4, K=128, V=128, init=True) -> dict:
    from longstraw_mcore.ops.kda import kda_gate

    g0 = torch.Generator().manual_seed(0)
    f = torch.randn(B, T, H * K, generator=g0)
    A_log = (torch.rand(H, generator=g0) * 15 + 1).log()
    x = dict(q=torch.randn(B, T, H, K, generator=g0), k=torch.randn(B, T, H, K, generator=g0),
             v=torch.randn(B, T, H, V, generator=g0), g=kda_gate(f, A_log, torch.ones(H * K), -5.0),
             beta=torch.rand(B, T, H, generator=g0))
    if init:
        x["s0"] = torch.randn(B, H, K, V, generator=g0) * 0.1
    return x


def _run(fn, mod, base: dict, dtype):
    t = {n: (x.cuda().to(dtype) if n in ("q", "k", "v") else x.cuda()).clone().requires_grad_()
         for n, x in base.items()}
    outs = fn(mod, **t)
    gen = torch.Generator(device="cuda").manual_seed(3)
    sum((o.float() * torch.randn(o.shape, generator=gen, device="cuda")).sum() for o in outs).backward()
    torch.cuda.synchronize()
    return {**{f"out{i}": o.detach() for i, o in enumerate(outs)}, **{f"d_{n}": x.grad for n, x in t.items()}}


def _both(fn, fla_mod, twin_mod, base: dict, dtype, label: str) -> dict:
    t0 = time.perf_counter()
    _run(fn, fla_mod, base, dtype)  # the first call: compile + autotune
    t1 = time.perf_counter()
    fast = _run(fn, fla_mod, base, dtype)
    t2 = time.perf_counter()
    print(f"[fla kda] {label}: first call {t1 - t0:.1f} s, again {(t2 - t1) * 1e3:.0f} ms")
    plain = _run(fn, twin_mod, base, dtype)
    return {k: _rel(fast[k], plain[k]) for k in plain}


def _check(errs: dict, dtype, label: str) -> None:
    print(label, {k: f"{v:.1e}" for k, v in errs.items()})
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, f"fla KDA vs twin ({label}) beyond {TOL[dtype]}: {bad}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["bounded", "general"])
def test_fla_kda_rule_equals_the_twin(dtype, path):
    from longstraw_mcore.ops import dispatch, kda

    base = _inputs()
    with dispatch.override(gdn="fla"):
        fla_mod = dispatch.kda_kernel(base["v"].cuda(), lower_bound=-5.0 if path == "bounded" else None)

    def rule(mod, q, k, v, g, beta, s0):
        return mod.chunk_kda(q, k, v, g, beta, s0, chunk_size=64)

    label = f"{path} {str(dtype).removeprefix('torch.')}"
    _check(_both(rule, fla_mod, kda, base, dtype, label), dtype, label)


def test_fla_kda_piece_maps_equal_the_twin():
    from longstraw_mcore.ops import dispatch, fla_kda, kda
    from longstraw_mcore.ops.gdn_pieces import piece_maps

    base = _inputs(B=1, T=200, init=False)
    base["g"] = base["g"] * 0.02  # a mild decay: M, the product of 200 steps, stays well inside float32

    def maps(mod, q, k, v, g, beta):
        with dispatch.override(gdn="fla" if mod is fla_kda else "plain"):
            pm = piece_maps(q, k, v, g, beta, chunk_size=64, rule=dispatch.kda_kernel(v).chunk_kda)
        return pm.c, pm.o0, pm.M, pm.B

    errs = _both(maps, fla_kda, kda, base, torch.bfloat16, "piece maps (bf16 q/k/v, float32 values K + V wide)")
    _check(errs, torch.float32, "piece maps")
