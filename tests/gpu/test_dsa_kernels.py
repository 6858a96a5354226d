"""The project's DSA Triton kernels (ops/dsa_triton_indexer.py, ops/dsa_triton_mla.py) equal the plain twins
(ops/dsa.py) on a CUDA device at GLM-5.2's head shapes (indexer: 32 heads of 128, top-k 2,048 of 6,144
keys; sparse MLA: 16 heads, latent 512, RoPE 64), on CUDA tensors compiled, not interpreted (the CPU
tests hold the algorithm; this holds the compiled kernels, where a GPU-only miscompile would show).
  - the indexer: float32 selection equal to the twin's (the same rows in the same order; float32 dots in
    IEEE float32 on both sides, the scores within 1e-5) and in bf16 at least 99.9% the same rows;
  - sparse MLA: o_lat, lse and every gradient (queries, W_UK, latents, RoPE keys; an upstream gradient
    into lse) within 1e-4 of their largest entry in float32, 2e-2 in bf16 (the twin rounds its logits to
    bf16, the kernel keeps them in float32).
Skipped without a GPU or without Triton; run by scripts/gpu_check.sh."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs a CUDA device and Triton")
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_kernel_on_cuda(dtype):
    from longstraw_mcore.ops import dsa, dsa_triton_indexer

    g = torch.Generator().manual_seed(0)
    B, T, S, HI, DI, k = 1, 64, 6144, 32, 128, 2048
    q = torch.randn(B, T, HI, DI, generator=g).cuda().to(dtype)
    key = torch.randn(B, S, DI, generator=g).cuda().to(dtype)
    w = (torch.randn(B, T, HI, generator=g) * HI ** -0.5).cuda().to(dtype)
    q_pos, k_pos = torch.arange(S - T, S).cuda(), torch.arange(S).cuda()
    r1, v1 = dsa.indexer_topk(q, key, w, q_pos, k_pos, k, 4096)
    r2, v2 = dsa_triton_indexer.indexer_topk(q, key, w, q_pos, k_pos, k)
    torch.cuda.synchronize()
    same = float((torch.sort(r1, -1).values == torch.sort(r2, -1).values).float().mean())
    print(f"indexer {dtype}: same rows {same:.5f}, ordered equal {bool((r1 == r2).all())}, scores {_rel(v2, v1):.1e}")
    if dtype == torch.float32:
        assert bool((r1 == r2).all()) and _rel(v2, v1) <= 1e-5
    else:
        assert same >= 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_kernel_on_cuda(dtype):
    from longstraw_mcore.ops import dsa, dsa_triton_mla

    g = torch.Generator().manual_seed(1)
    B, T, S, H, Dn, Dr, R, k = 1, 48, 4096, 16, 192, 64, 512, 2048
    base = dict(qn=torch.randn(B, T, H, Dn, generator=g), qp=torch.randn(B, T, H, Dr, generator=g),
                c=torch.randn(B, S, R, generator=g), pe=torch.randn(B, S, Dr, generator=g),
                wuk=torch.randn(H, Dn, R, generator=g) * Dn ** -0.5)
    idx = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B * T)]).view(B, T, k).cuda()
    valid = (torch.rand(B, T, k, generator=g) > 0.1).cuda()
    go, gl = torch.randn(B, T, H, R, generator=g).cuda(), torch.randn(B, T, H, generator=g).cuda()
    res = {}
    for name, mod in (("kernel", dsa_triton_mla), ("twin", dsa)):
        t = {n: x.cuda().to(dtype).requires_grad_() for n, x in base.items()}
        o, lse = mod.mla_sparse_partial(t["qn"], t["qp"], t["c"], t["pe"], t["wuk"], idx, valid, (Dn + Dr) ** -0.5)
        ((o.float() * go).sum() + (lse.float() * gl).sum()).backward()
        res[name] = {"o_lat": o, "lse": lse, **{f"d_{n}": x.grad for n, x in t.items()}}
    errs = {n: _rel(res["kernel"][n], res["twin"][n]) for n in res["twin"]}
    print(f"sparse MLA {dtype}:", {n: f"{e:.1e}" for n, e in errs.items()})
    bad = {n: e for n, e in errs.items() if not e <= TOL[dtype]}
    assert not bad, f"kernel vs twin ({dtype}) beyond {TOL[dtype]}: {bad}"
