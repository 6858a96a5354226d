"""The plain Kimi Delta Attention twin (ops/kda.py: `recurrent_kda`, `chunk_kda`, `kda_gate`) equals transformers'
GLM-5.3-Flash functions (`recurrent_kimi_delta_attention`, `chunk_kimi_delta_attention`, `Glm5NextTextForgetGate`,
their torch binding: bench/hf_kernels.py `glm5_next_modeling(fla=False)`) in float64, their float32 casts lifted
(tests/hf_reference.py `LiftFloat32ToFloat64`):

- the gate, bounded (lower bound -5: g in (-5, 0)) and unbounded (-e^A softplus), <= 1e-14;
- outputs and final states of both our forms, from a random initial state, over 37 tokens: chunks of 16 (two
  whole chunks and a tail of 5: the tail continues from the whole chunks' state), of 64 (one short chunk) and
  of 1, against transformers' recurrence, <= 1e-12 relative to the largest entry;
- the gradients of q, k, v, g, beta and the initial state (a fixed random functional of the output and the
  final state) of the chunked form against autograd through transformers' recurrence, <= 1e-12;
- a strong decay (g near -5 per token: the cumulative decay of a 64-token chunk reaches -320, where a factored
  exp(G) exp(-G) would overflow): finite, equal to the recurrence;
- two calls carrying the state (first 20 tokens, then 17 from their final state) equal one call over 37.
"""

from __future__ import annotations

import torch
from layout_compare import rel as _rel

from longstraw_mcore.bench.hf_kernels import glm5_next_modeling
from longstraw_mcore.ops.kda import chunk_kda, kda_gate, recurrent_kda

B, T, H, K, V = 2, 37, 3, 8, 6
F64 = torch.float64


def _inputs(seed: int, lower: float = -5.0, strong: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    u = torch.rand(B, T, H, K, generator=gen, dtype=F64)
    g = lower * (0.98 + 0.02 * u) if strong else lower * u
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=F64) * 0.3
    return q, k, v, g, beta, s0


def _hf_recurrent(q, k, v, g, beta, s0):
    from hf_reference import LiftFloat32ToFloat64

    hf = glm5_next_modeling(fla=False)
    with LiftFloat32ToFloat64():
        return hf.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)


def test_gate_equals_transformers_bounded_and_unbounded():
    from hf_reference import LiftFloat32ToFloat64

    hf = glm5_next_modeling(fla=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, 16, generator=gen, dtype=F64)
    for lower in (-5.0, None):
        with LiftFloat32ToFloat64():
            cfg = hf.Glm5NextTextConfig(hidden_size=16, linear_num_heads=H, linear_head_dim=K)
            cfg.linear_lower_bound = lower  # (the gate reads it at construction)
            gate = hf.Glm5NextTextForgetGate(cfg).to(F64)
            for p in gate.parameters():
                torch.nn.init.normal_(p, std=0.3, generator=gen)
            want = gate(x)
        got = kda_gate(gate.f_b_proj(gate.f_a_proj(x)), gate.A_log, gate.dt_bias, lower)
        assert got.shape == (B, T, H, K) and bool((got < 0).all()), (lower, got.shape)
        if lower is not None:
            assert bool((got > lower).all())
        assert _rel(got, want) <= 1e-14, (lower, _rel(got, want))


def test_forms_equal_transformers_outputs_states_and_gradients():
    q, k, v, g, beta, s0 = _inputs(0)
    o_ref, s_ref = _hf_recurrent(q, k, v, g, beta, s0)
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, s0, state_dtype=F64)
    assert _rel(o_rec, o_ref) <= 1e-12 and _rel(s_rec, s_ref) <= 1e-12, (_rel(o_rec, o_ref), _rel(s_rec, s_ref))
    for C in (16, 64, 1):
        o, s = chunk_kda(q, k, v, g, beta, s0, chunk_size=C, state_dtype=F64)
        assert o.dtype == F64 and o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
        assert _rel(o, o_ref) <= 1e-12 and _rel(s, s_ref) <= 1e-12, (C, _rel(o, o_ref), _rel(s, s_ref))

    gen = torch.Generator().manual_seed(9)
    wo, ws = torch.randn(B, T, H, V, generator=gen, dtype=F64), torch.randn(B, H, K, V, generator=gen, dtype=F64)

    def grads(fn):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, s0)]
        o, s = fn(*xs)
        ((o * wo).sum() + (s * ws).sum()).backward()
        return [x.grad for x in xs]

    want = grads(_hf_recurrent)
    got = grads(lambda *xs: chunk_kda(*xs, chunk_size=16, state_dtype=F64))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), got, want):
        assert _rel(a, b) <= 1e-12 and float(b.abs().max()) > 0, (name, _rel(a, b))


def test_strong_decay_and_carried_state():
    q, k, v, g, beta, s0 = _inputs(1, strong=True)
    assert float(g[:, :16].sum(1).min()) < -70  # 16 tokens already past what float32 e^{-G} could hold
    o_ref, s_ref = _hf_recurrent(q, k, v, g, beta, s0)
    o, s = chunk_kda(q, k, v, g, beta, s0, chunk_size=64, state_dtype=F64)
    assert bool(torch.isfinite(o).all()) and _rel(o, o_ref) <= 1e-12 and _rel(s, s_ref) <= 1e-12

    q, k, v, g, beta, s0 = _inputs(2)
    whole = chunk_kda(q, k, v, g, beta, s0, chunk_size=16, state_dtype=F64)
    o1, s1 = chunk_kda(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], s0, chunk_size=16, state_dtype=F64)
    o2, s2 = chunk_kda(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], s1, chunk_size=16, state_dtype=F64)
    assert _rel(torch.cat([o1, o2], 1), whole[0]) <= 1e-12 and _rel(s2, whole[1]) <= 1e-12
