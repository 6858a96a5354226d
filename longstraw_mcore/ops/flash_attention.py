"""FlashAttention partial kernels: torch's own fused attention ops behind the interface of
ops/block_attention.py (`partial_forward`, `partial_backward`), so the merge Function and the context-
and KV-group-parallel attention call them unchanged (ops/dispatch.py picks the kernel). Two ops:

    CUDA  aten::_flash_attention_forward / _backward          bf16 / fp16, head dim <= 256, [B,T,H,D]
    CPU   aten::_scaled_dot_product_flash_attention_for_cpu   float64 / float32 (bf16 / fp16 inputs run
          (and _backward)                                     in float32, the twin's work dtype), query,
                                                              key and value head dims equal, [B,H,T,D]
Both return the log-sum-exp the merge needs, take GQA natively (Hq = r * Hk, dK/dV per key head) and
compute the backward's row term themselves.

Masking. Key j (absolute k_start + j) is visible to query i (absolute q_start + i) iff j <= i + d,
d = q_start - k_start. The ops know two masks: none, and causal, aligned bottom-right by the CUDA op
(query i of T sees keys j <= i + S - T) and top-left by the CPU op (j <= i). `_calls` covers the rule
with op calls on row and key ranges:
  - every key visible to every query (d >= S - 1; the prompt state seen by a branch): one call, no mask;
  - queries i < -d see no key (out 0, lse -inf, no call);
  - queries a..b-1 (a = max(0, -d), b = min(T, S - d)) see keys j <= i + d: one bottom-right causal call
    over keys [0, b + d); for a top-left op, keys [0, a + d) unmasked plus the square [a + d, b + d)
    causal, merged by log-sum-exp (both alignments agree on a square);
  - queries b.. see all S keys: one call, no mask;
keys no query sees get no gradient. Rows that see no key come back from the CUDA op with lse = +inf:
mapped to lse = -inf, out = 0 (what the merge expects). In the backward, the merged lse's -inf rows are
passed as +inf (p = 0 there).

Batch. A key set of batch 1 serving B query rows (the prompt state, batched branches) with every key
visible runs as one sequence of B*T queries: no copy of the state per row, and the op's dK/dV is
already the sum over the rows. Under a causal mask it is expanded to the batch instead.

Backward. The op computes the row term itself, as rowsum(dO * O) from the `out` it is given. The
caller's delta also carries -dlse (an lse that is used downstream, e.g. merged across ranks by
autograd), so the op gets O' = dO * delta / |dO|^2 per row, for which rowsum(dO * O') = delta. A row
with dO = 0 but delta != 0 cannot be written that way: that call falls back to the plain kernel. Each
piece of a split call gets the merged lse, so its p is its exact share (the ring-attention recipe).

`_ops(q)` is the one place that picks the op (device); `_op_forward` / `_op_backward` (CUDA: positional
arguments, the output names changed between torch 2.6 and 2.7) and `_cpu_forward` / `_cpu_backward`
the only places that touch one. tests/unit/test_flash_adapter.py runs the CPU op against the plain twin
and, for the CUDA plumbing, a plain implementation of the CUDA op's documented contract put in `_ops`;
tests/gpu/ compares the real CUDA op with the plain twin.
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops import block_attention as plain
from longstraw_mcore.ops.attention_merge import merge_partials, work_dtype

DTYPES = (torch.bfloat16, torch.float16)


def available(q: torch.Tensor | None = None) -> bool:
    """Whether this torch has the op for `q`'s device (CUDA without `q`)."""
    if q is not None and q.device.type == "cpu":
        return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def _ops(q: torch.Tensor):
    """(forward, backward, bottom-right causal alignment, dtype the op runs in) for `q`'s device."""
    if q.device.type == "cpu":
        return _cpu_forward, _cpu_backward, False, work_dtype(q.dtype)
    return _op_forward, _op_backward, True, q.dtype


def _op_forward(q, k, v, causal: bool, scale: float):
    """CUDA: q [B,T,Hq,D], k/v [B,S,Hk,*] (same dtype) -> (out [B,T,Hq,Dv] q.dtype, lse [B,Hq,T] float32,
    +inf for rows that see no key)."""
    r = torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False,
                                                scale=scale)
    return r[0], r[1]


def _op_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    """CUDA: (dq, dk, dv) in the inputs' layouts and dtype, from the *given* out / lse (float32, +inf = empty
    row)."""
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: the generator state is not read
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    r = torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0,
                                                 causal, rng, unused, scale=scale)
    return r[0], r[1], r[2]


def _cpu_forward(q, k, v, causal: bool, scale: float):
    """The CPU op with _op_forward's contract (layouts [B,T,H,*]; no row sees no key here)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def _cpu_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    tr = lambda x: x.transpose(1, 2)  # noqa: E731 (the op takes [B,H,T,D] views; strides are honoured)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        tr(do), tr(q), tr(k), tr(v), tr(out), lse, 0.0, causal, scale=scale)
    return tr(dq), tr(dk), tr(dv)


def _calls(T: int, S: int, d: int, bottom_right: bool) -> list[tuple[int, int, int, int, bool]]:
    """(q0, q1, k0, k1, causal) op calls for query i of T seeing keys j < min(S, i + d + 1) (module
    docstring, "Masking"); rows of several calls are merged by log-sum-exp."""
    if d >= S - 1:
        return [(0, T, 0, S, False)] if T and S else []
    a = min(T, max(0, -d))
    b = min(T, max(a, S - d))
    calls = []
    if b > a:
        if bottom_right or a + d == 0:
            calls.append((a, b, 0, b + d, True))
        else:
            calls += [(a, b, 0, a + d, False), (a, b, a + d, b + d, True)]
    if T > b:
        calls.append((b, T, 0, S, False))
    return calls


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


def _layout(q, k, v, q_start, k_start, dtype):
    """(calls, keys any query sees, fold, q, k, v) ready for the op: the calls (`_calls`), keys cut to the
    visible ones, batch folded (every key visible to every query: one call over B*T queries) or
    expanded, in the op's dtype."""
    B, T = q.shape[:2]
    calls = _calls(T, k.shape[1], q_start - k_start, _ops(q)[2])
    s_vis = max((k1 for *_, k1, _ in calls), default=0)
    k, v = k[:, :s_vis], v[:, :s_vis]
    fold = k.shape[0] == 1 and B > 1 and len(calls) == 1 and not calls[0][4]
    if fold:
        q, calls = _fold(q), [(0, B * T, 0, s_vis, False)]
    elif k.shape[0] == 1 and B > 1:
        k, v = k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])
    return calls, s_vis, fold, q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()


def _applies(q, v) -> bool:
    """The CPU op needs the values' head dim to be the queries' (elsewhere: the plain twin)."""
    return q.device.type != "cpu" or v.shape[-1] == q.shape[-1]


def partial_forward(q, k, v, q_start: int, k_start: int, scale: float, block: int, store: bool):
    """block_attention.partial_forward's contract: (out [B,Hq,T,Dv] work dtype, lse [B,Hq,T] work dtype,
    None)."""
    if not _applies(q, v):
        return plain.partial_forward(q, k, v, q_start, k_start, scale, block, store)
    B, T, Hq, _ = q.shape
    work = work_dtype(q.dtype)
    fwd, _, _, dtype = _ops(q)
    calls, s_vis, fold, qx, kx, vx = _layout(q, k, v, q_start, k_start, dtype)
    Bq, Tq = qx.shape[:2]
    out = torch.zeros(Bq, Hq, Tq, v.shape[-1], dtype=work, device=q.device)
    lse = torch.full((Bq, Hq, Tq), float("-inf"), dtype=work, device=q.device)
    if s_vis == 0 or T == 0:  # (the CPU op divides by zero on an empty query set)
        return (torch.zeros(B, Hq, T, v.shape[-1], dtype=work, device=q.device),
                torch.full((B, Hq, T), float("-inf"), dtype=work, device=q.device), None)
    by_rows: dict[tuple[int, int], list] = {}
    for q0, q1, k0, k1, c in calls:
        o, l = fwd(qx[:, q0:q1], kx[:, k0:k1], vx[:, k0:k1], c, scale)
        l = l.to(work)
        empty = torch.isposinf(l)                                      # (CUDA: rows that see no key)
        by_rows.setdefault((q0, q1), []).append((o.to(work).transpose(1, 2).masked_fill(empty[..., None], 0.0),
                                                 l.masked_fill(empty, float("-inf"))))
    for (q0, q1), parts in by_rows.items():
        out[:, :, q0:q1], lse[:, :, q0:q1] = merge_partials(parts, None, work, q.device)
    if fold:  # (contiguous, as the twin's: callers reduce them across ranks, and collectives need it)
        out, lse = out.reshape(Hq, B, T, -1).transpose(0, 1).contiguous(), _lse_unfold(lse, B).contiguous()
    return out, lse, None


def partial_backward(q, k, v, do, delta, lse, q_start: int, k_start: int, scale: float, block: int, kept,
                     need_q: bool, need_k: bool, need_v: bool, sink=None, sink_scale: float = 1.0):
    """block_attention.partial_backward's contract (do [B,Hq,T,Dv], delta / lse [B,Hq,T] work dtype, lse
    the merged one): (dq [B,Hq,T,D] or None, dk, dv [Bk,Hk,S,*] or None; with `sink` dK/dV added there)."""
    B, T, Hq, D = q.shape
    Bk, S, Hk = k.shape[:3]
    work = work_dtype(q.dtype)
    norm2 = (do * do).sum(-1)
    if not _applies(q, v) or bool(((norm2 == 0) & (delta != 0)).any()):  # (delta not expressible through O')
        return plain.partial_backward(q, k, v, do, delta, lse, q_start, k_start, scale, block, None,
                                      need_q, need_k, need_v, sink=sink, sink_scale=sink_scale)
    _, bwd, _, dtype = _ops(q)
    calls, s_vis, fold, qx, kx, vx = _layout(q, k, v, q_start, k_start, dtype)
    dq = torch.zeros(B, Hq, T, D, dtype=work, device=q.device) if need_q else None
    dk = dv = None
    if sink is None:
        dk = torch.zeros(Bk, Hk, S, D, dtype=work, device=q.device) if need_k else None
        dv = torch.zeros(Bk, Hk, S, v.shape[-1], dtype=work, device=q.device) if need_v else None
    if s_vis == 0 or T == 0:
        return dq, dk, dv
    o_eff = do * (delta / torch.where(norm2 == 0, torch.ones_like(norm2), norm2))[..., None]   # [B,Hq,T,Dv]
    lse_op = lse.masked_fill(torch.isneginf(lse), float("inf"))
    lse_op = lse_op.to(torch.float32 if dtype in DTYPES else dtype)       # (the CUDA op's lse is float32)
    do_x, o_x = do.transpose(1, 2).to(dtype), o_eff.transpose(1, 2).to(dtype)            # [B,T,Hq,Dv]
    if fold:
        do_x, o_x, lse_op = _fold(do_x), _fold(o_x), _lse_fold(lse_op)
    do_x, o_x = do_x.contiguous(), o_x.contiguous()
    gq = gk = gv = None
    for q0, q1, k0, k1, c in calls:
        a, b, e = bwd(do_x[:, q0:q1], qx[:, q0:q1], kx[:, k0:k1], vx[:, k0:k1], o_x[:, q0:q1],
                      lse_op[:, :, q0:q1].contiguous(), c, scale)
        if len(calls) == 1 and (q0, q1, k0, k1) == (0, qx.shape[1], 0, s_vis):
            gq, gk, gv = a, b, e
            break
        if gq is None:
            gq, gk, gv = torch.zeros_like(qx), torch.zeros_like(kx), torch.zeros_like(vx)
        gq[:, q0:q1] += a
        gk[:, k0:k1] += b
        gv[:, k0:k1] += e
    if need_q:
        dq = gq.reshape(B, T, Hq, D).to(work).transpose(1, 2).contiguous()
    if sink is None and not (need_k or need_v):  # (the prompt state in detached mode: the op's dK / dV unused,
        return dq, None, None                    # not copied to the work dtype)
    if Bk == 1 and gk.shape[0] > 1:  # [B, S', Hk, *] expanded over the batch: summed in the work dtype
        gk, gv = gk.to(work).sum(0, keepdim=True), gv.to(work).sum(0, keepdim=True)
    if sink is not None:  # (memory.state_offload: a host sink gets the op's dtype over the wire, added in its own)
        for dst, g in zip(sink, (gk, gv)):
            dst[:, :s_vis] += (g.to(dst.device, dst.dtype) * sink_scale if sink_scale != 1.0 else g.to(dst.device))
        return dq, None, None
    if need_k:  # (the copy converts to the work dtype)
        dk[:, :, :s_vis] = gk.transpose(1, 2)
    if need_v:
        dv[:, :, :s_vis] = gv.transpose(1, 2)
    return dq, dk, dv
