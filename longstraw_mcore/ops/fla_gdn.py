"""Gated delta rule on CUDA through flash-linear-attention (`fla.ops.gated_delta_rule`), behind the
contract of ops/gated_delta.chunk_gated_delta_rule: q, k [B,T,h,K] (h key heads), v [B,T,H,V] with
H = r*h, g (log decay) / beta [B,T,H], an initial state [B,H,K,V] -> (o [B,T,H,V] in v's dtype, final
state [B,H,K,V] in the state dtype).

What the adapter does around the kernel: each q/k head serves r consecutive value heads (repeated here,
as transformers does before its fla call); the L2 norms of q and k run inside the kernel
(`use_qk_l2norm_in_kernel`) and q is scaled by K^-0.5 (`scale`), as the plain rule does; g, beta and
the states go in as float32 (fla keeps its states in float32; exact mode's state gradient reaches
`initial_state` through fla's backward). The chunk length is the kernel's own (64).

Requires the `gpu` extra (flash-linear-attention with Triton >= 3.7.1: older Triton gives wrong fla
gradients on Hopper). The CPU test environment keeps fla out; tests/unit/test_fla_adapter.py checks the
plumbing against the plain rule with a stand-in module of fla's documented signature.
"""

from __future__ import annotations

import importlib.util

import torch

DTYPES = (torch.bfloat16, torch.float16)


MIN_TRITON = (3, 7, 1)


def missing() -> str | None:
    """Why fla cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (the gpu extra)"
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    have = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3] if x.isdigit())
    if have < MIN_TRITON:
        return f"triton {triton.__version__} < 3.7.1 (fla's gradients are wrong on Hopper with older Triton)"
    return None


def available() -> bool:
    return missing() is None


def supports(v: torch.Tensor) -> bool:
    return v.is_cuda and v.dtype in DTYPES


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                           state_dtype=torch.float32):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    r = v.shape[2] // q.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous()
    h0 = None if initial_state is None else initial_state.float()
    o, final = fla_rule(q, k, v.contiguous(), g.float().contiguous(), beta.to(v.dtype).contiguous(),
                        scale=q.shape[-1] ** -0.5, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype), final.to(state_dtype)
