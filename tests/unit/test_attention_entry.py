"""The one attention entry point (`ops.attention.attention`) against plain autograd over concatenated
keys: several key sets merged in one autograd node whose backward gives each set's backward the
*merged* out and lse. Covered: a prompt set of batch 1 serving a batch of branches with its dK/dV
accumulated into float32 sinks (the exact-mode state gradient: accumulation across calls, summed over
the batch, never returned through autograd), query blocking (queries longer than a block), GQA,
stored probabilities, and a differentiable lse (the cross-rank merge of context parallelism will
back-propagate into it). Not covered here: a fused GPU kernel (none is plugged in yet)."""

from __future__ import annotations

import pytest
import torch

from longstraw_mcore.ops.attention import KeySet, attention, cached_causal_attention

F64 = torch.float64


def _reference(q, kp, vp, kb, vb, P):
    """Plain attention over [prompt (expanded over the batch), own keys]; (out, lse)."""
    B, T, Hq, D = q.shape
    k = torch.cat([kp.expand(B, -1, -1, -1), kb], 1)
    v = torch.cat([vp.expand(B, -1, -1, -1), vb], 1)
    out = cached_causal_attention(q, k[:, P:], v[:, P:], k[:, :P], v[:, :P])
    rep = Hq // kb.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, 2)) * D ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(P + T)[None, :]
    lse = torch.logsumexp(s.masked_fill(j > i + P, float("-inf")), -1).transpose(1, 2)
    return out, lse


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("B,P,T,block,Hq,Hk", [(3, 11, 5, 4, 4, 2), (2, 30, 13, 4, 2, 1), (1, 7, 9, 64, 6, 3)])
def test_merged_sets_with_state_sinks_equal_plain_autograd(B, P, T, block, Hq, Hk, store):
    g = torch.Generator().manual_seed(B * 100 + P)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    q, kb, vb = rnd(B, T, Hq, 8).requires_grad_(), rnd(B, T, Hk, 8).requires_grad_(), rnd(B, T, Hk, 8).requires_grad_()
    kp, vp = rnd(1, P, Hk, 8), rnd(1, P, Hk, 8)
    w_out, w_lse = rnd(B, T, Hq, 8), rnd(B, T, Hq)

    ref_kp, ref_vp = kp.clone().requires_grad_(), vp.clone().requires_grad_()
    ref_out, ref_lse = _reference(q, ref_kp, ref_vp, kb, vb, P)
    ((ref_out * w_out).sum() + (ref_lse * w_lse).sum()).backward()
    ref = {"q": q.grad, "k_branch": kb.grad, "v_branch": vb.grad, "k_prompt": ref_kp.grad, "v_prompt": ref_vp.grad}
    ref = {k: v.clone() for k, v in ref.items()}
    for x in (q, kb, vb):
        x.grad = None

    prior = rnd(1, P, Hk, 8), rnd(1, P, Hk, 8)          # sinks already hold earlier branches' gradients
    sink = (prior[0].clone(), prior[1].clone())
    out, lse = attention(q, [KeySet(kp, vp, 0, grad=sink, store_probs=store), KeySet(kb, vb, P)], q_start=P,
                         block=block)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    got = {"q": q.grad, "k_branch": kb.grad, "v_branch": vb.grad, "k_prompt": sink[0] - prior[0],
           "v_prompt": sink[1] - prior[1]}
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-13) and torch.allclose(lse, ref_lse, rtol=0, atol=1e-13)
    for name, r in ref.items():
        assert torch.allclose(got[name], r, rtol=0, atol=1e-12), f"d{name} drifted: {(got[name] - r).abs().max():.2e}"
    assert kp.grad is None and vp.grad is None  # the state gradient went to the sinks only


def test_one_causal_call_over_a_buffer_and_query_blocks():
    """Capture's form: queries of a chunk at s0 against the buffer [0, s1) in one call, with more
    queries than a block (each query block walks only the key blocks it can see)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 40, 2, 8, generator=g, dtype=F64), torch.randn(1, 40, 2, 8, generator=g, dtype=F64)
    q = torch.randn(1, 23, 4, 8, generator=g, dtype=F64)
    out, _ = attention(q, [KeySet(k, v, 0)], q_start=17, block=5)
    ref = cached_causal_attention(q, k[:, 17:], v[:, 17:], k[:, :17], v[:, :17])
    assert torch.allclose(out, ref, rtol=0, atol=1e-13)


def test_bad_key_sets_are_refused():
    q = torch.zeros(2, 3, 4, 8)
    with pytest.raises(ValueError, match="not a multiple of key heads 3"):
        attention(q, [KeySet(torch.zeros(2, 5, 3, 8), torch.zeros(2, 5, 3, 8), 0)], q_start=5)
    with pytest.raises(ValueError, match="key batch 3 is neither 1 nor the query batch 2"):
        attention(q, [KeySet(torch.zeros(3, 5, 2, 8), torch.zeros(3, 5, 2, 8), 0)], q_start=5)
    with pytest.raises(ValueError, match="no key sets"):
        attention(q, [], q_start=0)
