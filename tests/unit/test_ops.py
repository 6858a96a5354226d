"""Plain-torch ops against their twins: chunked vs token-by-token gated delta rule, both vs the
Hugging Face reference functions, state continuation (the hook branch replay uses), causal conv
with a carried window, cached attention, and partial RoPE vs the reference's multi-section RoPE."""

from __future__ import annotations

import functools

import pytest
import torch

from longstraw_mcore.ops.attention import apply_partial_rope, cached_causal_attention, rope_cos_sin
from longstraw_mcore.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule

F64 = torch.float64


def _inputs(B, T, h, H, K, V, seed=0, decay=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, h, K, generator=g, dtype=F64)
    k = torch.randn(B, T, h, K, generator=g, dtype=F64)
    v = torch.randn(B, T, H, V, generator=g, dtype=F64)
    gl = -decay * torch.rand(B, T, H, generator=g, dtype=F64)
    beta = torch.rand(B, T, H, generator=g, dtype=F64)
    s0 = torch.randn(B, H, K, V, generator=g, dtype=F64)
    return [x.requires_grad_() for x in (q, k, v, gl, beta, s0)]


def _run(fn, xs, **kw):
    q, k, v, g, beta, s0 = xs
    for x in xs:
        x.grad = None
    o, s = fn(q, k, v, g, beta, s0, **kw)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    ws = torch.randn(s.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    ((o * w).sum() + (s * ws).sum()).backward()
    return {"out": o.detach(), "state": s.detach(),
            **{f"d{n}": x.grad.clone() for n, x in zip(("q", "k", "v", "g", "beta", "s0"), xs)}}


def _assert_close(a: dict, b: dict, tol: float, what: str):
    for name in a:
        err = float((a[name] - b[name]).abs().max() / b[name].abs().max().clamp_min(1e-300))
        assert err <= tol, f"{what}: {name} drifted, rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("T,chunk,h,H", [(1, 4, 1, 1), (7, 4, 2, 2), (16, 8, 1, 3), (37, 16, 2, 4), (37, 64, 2, 4)])
def test_chunk_equals_recurrent_outputs_states_grads(T, chunk, h, H):
    xs = _inputs(2, T, h, H, 8, 6)
    ref = _run(lambda *a, **k: recurrent_gated_delta_rule(*a, state_dtype=F64), xs)
    got = _run(lambda *a, **k: chunk_gated_delta_rule(*a, chunk_size=chunk, state_dtype=F64), xs)
    _assert_close(got, ref, 1e-12, f"T={T} chunk={chunk}")


@pytest.mark.parametrize("use", ["out", "state", "out+const_s0"])
def test_chunk_gradients_when_part_is_unused(use):
    """The chunk loop's backward (ops/gated_delta._StateLoop) skips what nobody needs, as autograd would:
    the entering state's gradient for a constant one, the last update's for an unused final state, the
    outputs' path for unused outputs. Gradients still equal the token-by-token rule's (float64)."""
    q, k, v, g, beta, s0 = _inputs(2, 37, 2, 4, 8, 6, seed=11)
    if use == "out+const_s0":
        s0 = s0.detach()
    init = None if use == "out" else s0
    xs = [q, k, v, g, beta] + ([s0] if use == "state" else [])
    w = torch.randn(2, 37, 4, 6, generator=torch.Generator().manual_seed(9), dtype=F64)
    ws = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(8), dtype=F64)
    grads = []
    for fn in (recurrent_gated_delta_rule, functools.partial(chunk_gated_delta_rule, chunk_size=8)):
        o, s = fn(q, k, v, g, beta, init, state_dtype=F64)
        grads.append(torch.autograd.grad((s * ws).sum() if use == "state" else (o * w).sum(), xs,
                                         allow_unused=True))
    for name, a, b in zip("q k v g beta s0".split(), *grads):
        if name == "q" and use == "state":  # the final state does not depend on q
            assert a is None and b is None
            continue
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= 1e-12, (use, name, err)


def test_state_continuation_equals_one_pass():
    """Running [0:a] then [a:T] from the carried state reproduces the single pass (outputs + state)."""
    q, k, v, g, beta, _ = [x.detach() for x in _inputs(1, 29, 2, 4, 8, 6, seed=3)]
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, None, chunk_size=8, state_dtype=F64)
    for a in (0, 1, 8, 13, 28):
        o1, s1 = chunk_gated_delta_rule(q[:, :a], k[:, :a], v[:, :a], g[:, :a], beta[:, :a], None, 8, F64)
        o2, s2 = chunk_gated_delta_rule(q[:, a:], k[:, a:], v[:, a:], g[:, a:], beta[:, a:], s1, 8, F64)
        assert torch.allclose(torch.cat([o1, o2], 1), o, rtol=0, atol=1e-12), a
        assert torch.allclose(s2, s, rtol=0, atol=1e-12), a


def test_matches_transformers_functions():
    """Same math as the reference's torch_chunk/recurrent_gated_delta_rule (run in float64)."""
    from hf_reference import LiftFloat32ToFloat64
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    xs = _inputs(2, 37, 2, 4, 8, 6, seed=5)
    ours = _run(lambda *a, **k: chunk_gated_delta_rule(*a, chunk_size=16, state_dtype=F64), xs)
    for fn in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        def hf(q, k, v, g, beta, s0, fn=fn):
            with LiftFloat32ToFloat64():
                return fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        _assert_close(ours, _run(hf, xs), 1e-12, fn.__name__)


def test_causal_conv_with_carried_window():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 23, 10, generator=g, dtype=F64)
    w = torch.randn(10, 4, generator=g, dtype=F64)
    ref = torch.nn.functional.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=3, groups=10)[..., :23].transpose(1, 2)
    y, state = causal_conv1d(x, w)
    assert torch.allclose(y, ref, atol=1e-13)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))
    for a in (1, 2, 5, 22):
        y1, s1 = causal_conv1d(x[:, :a], w)
        y2, s2 = causal_conv1d(x[:, a:], w, s1)
        assert torch.allclose(torch.cat([y1, y2], 1), ref, atol=1e-13), a
        assert torch.equal(s2, state), a


def test_cached_attention_equals_full_causal():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 15, 6, 8, generator=g, dtype=F64)
    k = torch.randn(2, 15, 2, 8, generator=g, dtype=F64)
    v = torch.randn(2, 15, 2, 8, generator=g, dtype=F64)
    full = cached_causal_attention(q, k, v)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(3, 2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(15, 15, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(3, 2))
    assert torch.allclose(full, ref, atol=1e-13)
    for p in (1, 6, 14):
        part = cached_causal_attention(q[:, p:], k[:, p:], v[:, p:], k[:, :p], v[:, :p])
        assert torch.allclose(part, full[:, p:], atol=1e-13), p


def test_partial_rope_is_the_reference_mrope_for_text_positions():
    """The reference's interleaved multi-section RoPE (T/H/W position rows) equals plain RoPE on the
    rotary dims when all three rows carry the same text positions; with distinct rows it does not."""
    from hf_reference import LiftFloat32ToFloat64, tiny_model_config
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

    from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict

    m = tiny_model_config(head_dim=64, partial_rotary_factor=0.5, rope_theta=1e6)
    raw = {k: v for k, v in hf_config_dict(m).items() if k not in ("architectures", "model_type", "dtype")}
    raw["rope_parameters"]["mrope_section"] = [6, 5, 5]
    raw["rope_parameters"]["mrope_interleaved"] = True
    with LiftFloat32ToFloat64():
        rot = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**raw))
    B, T, H, D = 2, 11, 3, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, T, H, D, generator=g, dtype=F64)
    kk = torch.randn(B, T, H, D, generator=g, dtype=F64)
    pos = torch.arange(100, 100 + T)
    cos, sin = rope_cos_sin(pos, m.rotary_dim, 1e6, F64)
    ours_q, ours_k = apply_partial_rope(q, cos, sin), apply_partial_rope(kk, cos, sin)

    def hf(position_ids):
        with LiftFloat32ToFloat64():
            c, s = rot(q, position_ids)
            return apply_rotary_pos_emb(q.transpose(1, 2), kk.transpose(1, 2), c, s)

    text = pos.view(1, 1, T).expand(3, B, T)
    hq, hk = hf(text)
    assert torch.allclose(ours_q, hq.transpose(1, 2), atol=1e-12)
    assert torch.allclose(ours_k, hk.transpose(1, 2), atol=1e-12)
    assert torch.equal(ours_q[..., m.rotary_dim:], q[..., m.rotary_dim:])  # pass-through dims untouched
    vision = torch.stack([text[0], text[1] + 7, text[2] * 2])
    vq, _ = hf(vision)
    assert not torch.allclose(vq.transpose(1, 2), ours_q, atol=1e-6)  # the reduction is not vacuous
