"""FlashAttention partial kernels for CUDA bf16 / fp16: torch's own flash ops behind the interface of
ops/block_attention.py (`partial_forward`, `partial_backward`), so the merge Function and the context-
and KV-group-parallel attention call them unchanged (ops/dispatch.py picks the kernel).

Masking. Key j (absolute k_start + j) is visible to query i (absolute q_start + i) iff
k_start + j <= q_start + i. Flash ops know two masks: none, and causal aligned bottom-right (query i of
T sees keys j <= i + S - T). So:
  - every key visible to every query (k_start + S - 1 <= q_start; the prompt state seen by a branch):
    no mask;
  - otherwise only the first S' = q_start + T - k_start keys are visible to any query, and over them the
    rule is exactly the bottom-right causal mask; keys past S' get no gradient;
  - S' <= 0: nothing is visible (out 0, lse -inf), no call.
Rows that see no key come back from the op with lse = +inf: mapped to lse = -inf, out = 0 (what the
merge expects). In the backward, the merged lse's -inf rows are passed as +inf (p = 0 there).

Batch. A key set of batch 1 serving B query rows (the prompt state, batched branches) with every key
visible runs as one sequence of B*T queries: no copy of the state per row, and the op's dK/dV is
already the sum over the rows. Under a causal mask it is expanded to the batch instead.

Backward. The op computes the row term itself, as rowsum(dO * O) from the `out` it is given. The
caller's delta also carries -dlse (an lse that is used downstream, e.g. merged across ranks by
autograd), so the op gets O' = dO * delta / |dO|^2 per row, for which rowsum(dO * O') = delta. A row
with dO = 0 but delta != 0 cannot be written that way: that call falls back to the plain kernel.
GQA runs natively (no K/V repeat): the op takes Hq = r * Hk and returns dK/dV per key head.

`_op_forward` / `_op_backward` are the only two places that touch the op (positional arguments: the
output names changed between torch 2.6 and 2.7); tests on CPU put a plain implementation of the op's
documented contract there (tests/unit/test_flash_adapter.py), tests/gpu/ compares the real op with
the plain twin.
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops import block_attention as plain
from longstraw_mcore.ops.attention_merge import work_dtype

DTYPES = (torch.bfloat16, torch.float16)


def available() -> bool:
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def supports(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in DTYPES and q.shape[-1] <= 256


def _op_forward(q, k, v, causal: bool, scale: float):
    """q [B,T,Hq,D], k/v [B,S,Hk,*] (same dtype) -> (out [B,T,Hq,Dv] q.dtype, lse [B,Hq,T] float32, +inf
    for rows that see no key)."""
    r = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False,
                                                scale=scale)
    return r[0], r[1]


def _op_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) in the inputs' layouts and dtype, from the *given* out / lse (float32, +inf = empty row)."""
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: the generator state is not read
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    r = torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0,
                                                 causal, rng, unused, scale=scale)
    return r[0], r[1], r[2]


def _visible(T: int, S: int, q_start: int, k_start: int) -> tuple[int, bool]:
    """(keys any query sees, causal mask needed over them)."""
    if k_start + S - 1 <= q_start:
        return S, False
    return max(0, min(S, q_start + T - k_start)), True


def _fold(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B*T, ...]"""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _lse_fold(lse: torch.Tensor) -> torch.Tensor:
    """[B, H, T] -> [1, H, B*T] (query b*T + t)"""
    B, H, T = lse.shape
    return lse.transpose(0, 1).reshape(1, H, B * T)


def _lse_unfold(lse: torch.Tensor, B: int) -> torch.Tensor:
    H = lse.shape[1]
    return lse.reshape(H, B, -1).transpose(0, 1)


def _layout(q, k, v, q_start, k_start):
    """(S', causal, fold, q, k, v) ready for the op: keys cut to the visible ones, batch folded or expanded."""
    B, T = q.shape[:2]
    s_vis, causal = _visible(T, k.shape[1], q_start, k_start)
    k, v = k[:, :s_vis], v[:, :s_vis]
    fold = k.shape[0] == 1 and B > 1 and not causal
    if fold:
        q = _fold(q)
    elif k.shape[0] == 1 and B > 1:
        k, v = k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])
    return s_vis, causal, fold, q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()


def partial_forward(q, k, v, q_start: int, k_start: int, scale: float, block: int, store: bool):
    """block_attention.partial_forward's contract: (out [B,Hq,T,Dv] float32, lse [B,Hq,T] float32, None)."""
    B, T, Hq, _ = q.shape
    work = work_dtype(q.dtype)
    s_vis, causal, fold, qx, kx, vx = _layout(q, k, v, q_start, k_start)
    if s_vis == 0:
        return (torch.zeros(B, Hq, T, v.shape[-1], dtype=work, device=q.device),
                torch.full((B, Hq, T), float("-inf"), dtype=work, device=q.device), None)
    out, lse = _op_forward(qx, kx, vx, causal, scale)
    if fold:
        out, lse = out.reshape(B, T, *out.shape[2:]), _lse_unfold(lse, B)
    lse = lse.to(work)
    empty = torch.isposinf(lse)
    lse = lse.masked_fill(empty, float("-inf"))
    out = out.to(work).transpose(1, 2).masked_fill(empty[..., None], 0.0)
    return out, lse, None


def partial_backward(q, k, v, do, delta, lse, q_start: int, k_start: int, scale: float, block: int, kept,
                     need_q: bool, need_k: bool, need_v: bool, sink=None, sink_scale: float = 1.0):
    """block_attention.partial_backward's contract (do [B,Hq,T,Dv], delta / lse [B,Hq,T] float32, lse the
    merged one): (dq [B,Hq,T,D] or None, dk, dv [Bk,Hk,S,*] or None; with `sink` dK/dV added there)."""
    B, T, Hq, D = q.shape
    Bk, S, Hk = k.shape[:3]
    work = work_dtype(q.dtype)
    norm2 = (do * do).sum(-1)
    if bool(((norm2 == 0) & (delta != 0)).any()):  # delta not expressible through O': the plain kernel
        return plain.partial_backward(q, k, v, do, delta, lse, q_start, k_start, scale, block, None,
                                      need_q, need_k, need_v, sink=sink, sink_scale=sink_scale)
    s_vis, causal, fold, qx, kx, vx = _layout(q, k, v, q_start, k_start)
    dq = torch.zeros(B, Hq, T, D, dtype=work, device=q.device) if need_q else None
    dk = dv = None
    if sink is None:
        dk = torch.zeros(Bk, Hk, S, D, dtype=work, device=q.device) if need_k else None
        dv = torch.zeros(Bk, Hk, S, v.shape[-1], dtype=work, device=q.device) if need_v else None
    if s_vis == 0:
        return dq, dk, dv
    o_eff = do * (delta / torch.where(norm2 == 0, torch.ones_like(norm2), norm2))[..., None]   # [B,Hq,T,Dv]
    lse_op = lse.masked_fill(torch.isneginf(lse), float("inf"))
    lse_op = lse_op.float() if q.dtype in DTYPES else lse_op            # the op's lse is float32
    do_x, o_x = do.transpose(1, 2).to(q.dtype), o_eff.transpose(1, 2).to(q.dtype)           # [B,T,Hq,Dv]
    if fold:
        do_x, o_x, lse_op = _fold(do_x), _fold(o_x), _lse_fold(lse_op)
    gq, gk, gv = _op_backward(do_x.contiguous(), qx, kx, vx, o_x.contiguous(), lse_op.contiguous(), causal, scale)
    if need_q:
        dq = gq.reshape(B, T, Hq, D).to(work).transpose(1, 2)
    gk, gv = gk.to(work), gv.to(work)                                      # [B or 1, S', Hk, *]
    if Bk == 1 and gk.shape[0] > 1:
        gk, gv = gk.sum(0, keepdim=True), gv.sum(0, keepdim=True)
    if sink is not None:
        sink[0][:, :s_vis] += (gk * sink_scale if sink_scale != 1.0 else gk).to(sink[0].device)  # a host sink:
        sink[1][:, :s_vis] += (gv * sink_scale if sink_scale != 1.0 else gv).to(sink[1].device)  # state offload
        return dq, None, None
    if need_k:
        dk[:, :, :s_vis] = gk.transpose(1, 2)
    if need_v:
        dv[:, :, :s_vis] = gv.transpose(1, 2)
    return dq, dk, dv
