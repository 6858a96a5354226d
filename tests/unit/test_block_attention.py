"""Blockwise attention (online softmax forward, recompute backward) against plain autograd
attention over the concatenated keys: outputs and gradients w.r.t. queries and *every* key/value set
(prompt-state gradients of exact mode), for several block sizes, GQA and split points, with the
prompt set's probabilities recomputed in the backward or stored by the forward. Each with both CPU
kernels (`kernel`: the plain twin, and torch's fused CPU op that ops.attention=auto takes; stored
probabilities are the twin's alone)."""

from __future__ import annotations

import pytest
import torch

from longstraw_mcore.ops.attention import cached_causal_attention
from longstraw_mcore.ops.attention import block_attention, merge_attention

F64 = torch.float64


@pytest.fixture(params=["plain", "flash"])
def kernel(request):
    from longstraw_mcore.ops import dispatch

    with dispatch.override(attention=request.param):
        yield request.param


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("P,T,block,Hq,Hk", [(0, 5, 4, 2, 2), (13, 6, 4, 6, 2), (40, 9, 7, 4, 1), (5, 1, 64, 4, 2), (9, 23, 4, 2, 1)])
def test_prompt_plus_branch_equals_full_attention(P, T, block, Hq, Hk, store, kernel):
    g = torch.Generator().manual_seed(P * 31 + T)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64).requires_grad_()  # noqa: E731
    q, kb, vb = mk(2, T, Hq, 8), mk(2, T, Hk, 8), mk(2, T, Hk, 8)
    kp, vp = mk(2, P, Hk, 8), mk(2, P, Hk, 8)
    w = torch.randn(2, T, Hq, 8, generator=g, dtype=F64)

    ref = cached_causal_attention(q, kb, vb, kp if P else None, vp if P else None)
    (ref * w).sum().backward()
    grad = lambda x: x.grad.clone() if x.grad is not None else torch.zeros_like(x)  # noqa: E731
    ref_grads = [grad(x) for x in (q, kb, vb, kp, vp)]
    for x in (q, kb, vb, kp, vp):
        x.grad = None
    parts = [block_attention(q, kb, vb, q_start=P, k_start=P, block=block, store_probs=store)]
    if P:
        parts.insert(0, block_attention(q, kp, vp, q_start=P, k_start=0, block=block, store_probs=store))
    out = merge_attention(parts)
    (out * w).sum().backward()
    assert torch.allclose(out, ref, rtol=0, atol=1e-13)
    for name, x, r in zip(("q", "k_branch", "v_branch", "k_prompt", "v_prompt"), (q, kb, vb, kp, vp), ref_grads):
        assert torch.allclose(grad(x), r, rtol=0, atol=1e-12), f"d{name} drifted: {(grad(x) - r).abs().max():.2e}"


def test_causal_within_one_set_and_lse(kernel):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 10, 2, 4, generator=g, dtype=F64)
    k = torch.randn(1, 10, 2, 4, generator=g, dtype=F64)
    v = torch.randn(1, 10, 2, 4, generator=g, dtype=F64)
    out, lse = block_attention(q, k, v, q_start=0, k_start=0, block=3)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, -1).transpose(1, 2), atol=1e-13)
    assert torch.allclose(out, cached_causal_attention(q, k, v), atol=1e-13)
    # queries before every key see nothing: out 0, lse -inf
    out, lse = block_attention(q[:, :2], k, v, q_start=0, k_start=5, block=4)
    assert torch.all(out == 0) and torch.all(torch.isinf(lse))


@pytest.mark.parametrize("store", [False, True])
def test_gradcheck_small(store, kernel):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 2, 3, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(1, 5, 1, 3, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(1, 5, 1, 3, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: block_attention(a, b, c, q_start=3, k_start=0, block=2, store_probs=store), (q, k, v))


def test_stored_probabilities_are_released_by_the_backward():
    from longstraw_mcore.ops import dispatch

    dispatch.configure(dispatch.OpsConfig(attention="plain"))  # (stored probabilities are the twin's)
    try:
        _stored_released()
    finally:
        dispatch.configure(dispatch.OpsConfig())


def _stored_released():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2, 8, generator=g, requires_grad=True)
    k, v = torch.randn(1, 300, 2, 8, generator=g), torch.randn(1, 300, 2, 8, generator=g)
    for store, extra in ((False, 0), (True, 1 * 2 * 4 * 300 + 5 * 1 * 2 * 4)):  # p blocks + one max per block
        out, lse = block_attention(q, k, v, q_start=300, k_start=0, block=64, store_probs=store)
        node = out.grad_fn
        # (keys without a gradient are held apart from the saved tensors: ops/attention.py)
        saved = sum(t.numel() for t in node.saved_tensors if t is not None) - sum(x.numel() for x in (q, out, lse))
        assert saved == extra, (store, saved)
        out.sum().backward()
        with pytest.raises(RuntimeError, match="freed"):
            node.saved_tensors
