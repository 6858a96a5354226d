"""torch's flash ops behind ops/flash_attention.py equal the plain twin on a CUDA device, in bf16:
every masking case of tests/unit/test_flash_adapter.py (forward partials and the backward from a
merged lse with a delta that carries -dlse, with and without a state sink), and the merged-attention
entry point with the dispatch on `auto` (flash) against `plain`. bf16 tolerance: 2e-2 of each
tensor's largest entry. Skipped without a GPU; run by scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF16 = torch.bfloat16


def _close(a, b, tol=2e-2):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-6)


def test_flash_partials_equal_the_twin():
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
    from test_flash_adapter import CASES

    from longstraw_mcore.ops import block_attention as plain
    from longstraw_mcore.ops import flash_attention as flash

    for name, B, Bk, T, S, q_start, k_start in CASES:
        g = torch.Generator().manual_seed(len(name))
        q = torch.randn(B, T, 4, 64, generator=g).to("cuda", BF16)
        k, v = (torch.randn(Bk, S, 2, 64, generator=g).to("cuda", BF16), torch.randn(Bk, S, 2, 64, generator=g).to("cuda", BF16))
        ro, rl, _ = plain.partial_forward(q, k, v, q_start, k_start, 0.125, 64, False)
        fo, fl, _ = flash.partial_forward(q, k, v, q_start, k_start, 0.125, 64, False)
        assert torch.equal(torch.isneginf(fl), torch.isneginf(rl)), name
        fin = ~torch.isneginf(rl)
        assert _close(fo, ro) and (not bool(fin.any()) or _close(fl[fin], rl[fin], 1e-3)), name
        lse = torch.logaddexp(rl, torch.randn(B, 4, T, generator=g).cuda())
        do = torch.randn(B, 4, T, 64, generator=g).cuda()
        delta = torch.randn(B, 4, T, generator=g).cuda()
        a = flash.partial_backward(q, k, v, do, delta, lse, q_start, k_start, 0.125, 64, None, True, True, True)
        b = plain.partial_backward(q, k, v, do, delta, lse, q_start, k_start, 0.125, 64, None, True, True, True)
        for x, y in zip(a, b):
            assert _close(x, y), name


def test_merged_attention_flash_equals_plain_bf16():
    from longstraw_mcore.ops import dispatch
    from longstraw_mcore.ops.attention import KeySet, attention
    from longstraw_mcore.ops import flash_attention

    g = torch.Generator().manual_seed(3)
    base = {n: torch.randn(*s, generator=g).to("cuda", BF16) for n, s in
            dict(q=(4, 33, 24, 256), kb=(4, 33, 4, 256), vb=(4, 33, 4, 256), kp=(1, 700, 4, 256),
                 vp=(1, 700, 4, 256)).items()}
    res = {}
    for choice in ("plain", "auto"):
        with dispatch.override(attention=choice):
            q = base["q"]
            assert (dispatch.attention_kernel(q) is flash_attention) == (choice == "auto")
            t = {n: x.clone().requires_grad_(n in ("q", "kb", "vb")) for n, x in base.items()}
            sink = tuple(torch.zeros(1, 700, 4, 256, device="cuda") for _ in range(2))
            out, lse = attention(t["q"], [KeySet(t["kp"], t["vp"], 0, grad=sink), KeySet(t["kb"], t["vb"], 700)], 700)
            (out.float().pow(2).sum() + lse.sum()).backward()
            res[choice] = [out, lse, t["q"].grad, t["kb"].grad, t["vb"].grad, *sink]
    for a, b in zip(res["auto"], res["plain"]):
        assert _close(a, b)
