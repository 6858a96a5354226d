"""The flash-linear-attention adapter (ops/fla_gdn.py) against the plain chunked rule, on CPU: fla is
not installed here (the CPU environment keeps it out), so `fla.ops.gated_delta_rule` is a stand-in of
its documented contract (q, k, v [B,T,H,*] with as many q/k heads as value heads; g the log decay;
L2 norms of q and k inside when `use_qk_l2norm_in_kernel`; q times `scale`; float32 states;
(o, final state or None)), written token by token. What is tested is the plumbing around the kernel:
the key heads repeated over their value heads, the scale, the dtypes of g / beta / states, the
returned state's dtype, and every gradient (exact mode's initial-state gradient included) equal to the
plain rule's, float32 <= 1e-5. The real kernel is compared on a GPU by the GPU check. Also the
dispatch of `ops.gdn`."""

from __future__ import annotations

import sys
import types

import pytest
import torch


def _stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **unused):
    assert q.shape == k.shape and q.shape[2] == v.shape[2], "fla takes one q/k head per value head"
    assert g.dtype == torch.float32 and (initial_state is None or initial_state.dtype == torch.float32)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6).to(q.dtype)
        k = k / torch.sqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6).to(k.dtype)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        err = v[:, t].float() - torch.einsum("bhkv,bhk->bhv", S, k[:, t].float())
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t].float(), err * beta[:, t, :, None].float())
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t].float()))
    return torch.stack(outs, 1).to(v.dtype), (S if output_final_state else None)


@pytest.fixture
def fla(monkeypatch):
    mod = types.ModuleType("fla.ops.gated_delta_rule")
    mod.chunk_gated_delta_rule = _stand_in
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", mod)


def test_fla_adapter_equals_the_plain_rule(fla):
    from longstraw_mcore.ops import fla_gdn, gated_delta

    g0 = torch.Generator().manual_seed(2)
    B, T, h, r, K, V = 2, 19, 2, 2, 8, 6
    base = dict(q=torch.randn(B, T, h, K, generator=g0), k=torch.randn(B, T, h, K, generator=g0),
                v=torch.randn(B, T, h * r, V, generator=g0), g=-torch.rand(B, T, h * r, generator=g0),
                beta=torch.rand(B, T, h * r, generator=g0), s0=torch.randn(B, h * r, K, V, generator=g0))
    res = {}
    for name, mod in (("plain", gated_delta), ("fla", fla_gdn)):
        t = {n: x.clone().requires_grad_() for n, x in base.items()}
        o, s = mod.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], t["s0"], chunk_size=8,
                                          state_dtype=torch.float32)
        assert o.dtype == torch.float32 and s.dtype == torch.float32 and s.shape == (B, h * r, K, V)
        (o.pow(2).sum() + (s * s.detach().sign()).sum()).backward()
        res[name] = [o, s, *(t[n].grad for n in base)]
    for a, b in zip(res["fla"], res["plain"]):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


def test_gdn_dispatch():
    from longstraw_mcore.ops import dispatch, gated_delta

    v = torch.randn(1, 3, 2, 4)
    assert dispatch.gdn_kernel(v) is gated_delta and dispatch.gdn_kernel(v.bfloat16()) is gated_delta
    with dispatch.override(gdn="fla"), pytest.raises(ValueError, match="ops.gdn=fla needs CUDA bf16/fp16 values, flash-linear-attention .* values are cpu torch.bfloat16"):
        dispatch.gdn_kernel(v.bfloat16())
    with dispatch.override(gdn="plain"):
        assert dispatch.gdn_kernel(v) is gated_delta
