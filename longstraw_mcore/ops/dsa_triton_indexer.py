"""The DSA indexer's top-k as one Triton kernel, behind the contract of ops/dsa.py's `indexer_topk`:

    indexer_topk(q, key, weights, q_pos, k_pos, k, counted) -> (rows [B, T, min(k, S)], scores, -inf invalid)

What a program does (grid: query blocks of BT x batch): for each block of KP keys (KP = k rounded up to
a power of two, at least 16) it forms that block's scores I[t, s] = sum_h w[t, h] ReLU(q[t, h] . key[s])
Di^-0.5 in float32 (dots with float32 accumulation, IEEE float32 for float32 inputs: no TF32), masks keys
after the query and keys not `counted` with -inf, and merges them into a running best KP per query held
in registers. No [queries, keys] score matrix exists anywhere, in memory or in registers: a program holds
[BT, KP] scores and its running best.

The selection and its tie-break are the twin's, exactly: each score and its key row are packed into one
int64, the score's float32 bits mapped to an order-preserving int32 in the high half (-0.0 made +0.0
first) and (2^32 - 1 - row) in the low half, so "a larger int64" is "a higher score, among equal
scores the earlier row" (rows are in position order). The merge is the bitonic one: the running best
sorted descending against the new block sorted ascending, their elementwise maximum holds the best KP of
the union, sorted again (`tl.sort`). Keys past the end are the smallest int64 (never chosen over a real
key, -inf ones included, which the twin also returns, in position order, where fewer than k are visible).

The keys may come in two parts (the prompt state's rows, then the call's own: ops/dsa.py), read where
they lie: the copy that joins them is never made.

Dtypes: float32, bf16, fp16 queries and keys (the scores in float32 either way); float64 is the twin's
(ops/dispatch.dsa_kernel). Memory: O(B T k) for the outputs. The index keys are read in the model dtype:
the prompt state keeps them unrounded under memory.state_dtype=fp8 (prompt_state/mla.py `exact_rows`:
fp8 index keys moved the gradient to cosine 0.887), so there is no fp8 path to read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw_mcore.ops.dsa import rows_count
from longstraw_mcore.ops.dsa_triton_common import in_place, pow2, row_strides

BT = 16  # queries per program (tl.dot needs >= 16 rows)


@triton.jit
def _pack(score, row):
    """(float32 score, int64 row) -> int64: larger = higher score, then earlier row."""
    score = tl.where(score == 0.0, 0.0, score)                       # -0.0 -> +0.0 (the twin's == ties)
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)            # order-preserving as signed int32
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - row)


@triton.jit
def _indexer_topk_kernel(q_ptr, k0_ptr, k1_ptr, w_ptr, qpos_ptr, kpos_ptr, counted_ptr, rows_ptr, vals_ptr,
                         T, S, N0, HI, scale, KK,
                         sq_b, sq_t, sq_h, sk0_b, sk0_s, sk1_b, sk1_s, sw_b, sw_t, so_b, so_t,
                         DI: tl.constexpr, DIP: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                         HAS_COUNTED: tl.constexpr, IEEE: tl.constexpr):
    pid_t, b = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = tl.arange(0, DIP)
    d_ok = d < DI
    qpos = tl.load(qpos_ptr + t, mask=t_ok, other=0)
    best = tl.full((BLOCK_T, KP), -9223372036854775808, tl.int64)
    for s0 in range(0, S, KP):
        s = s0 + tl.arange(0, KP)
        s_ok = s < S
        in0, in1 = s_ok & (s < N0), s_ok & (s >= N0)   # the key's two parts (head rows, then tail rows)
        keys = (tl.load(k0_ptr + b * sk0_b + s[:, None] * sk0_s + d[None, :], mask=in0[:, None] & d_ok[None, :],
                        other=0.0)
                + tl.load(k1_ptr + b * sk1_b + (s - N0)[:, None] * sk1_s + d[None, :],
                          mask=in1[:, None] & d_ok[None, :], other=0.0))
        acc = tl.zeros((BLOCK_T, KP), tl.float32)
        for h in range(HI):
            qh = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + h * sq_h + d[None, :],
                         mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                dots = tl.dot(qh, tl.trans(keys), input_precision="ieee")
            else:
                dots = tl.dot(qh, tl.trans(keys))
            wh = tl.load(w_ptr + b * sw_b + t * sw_t + h, mask=t_ok, other=0.0).to(tl.float32)
            acc += wh[:, None] * tl.maximum(dots * scale, 0.0)
        kpos = tl.load(kpos_ptr + s, mask=s_ok, other=0)
        visible = (kpos[None, :] <= qpos[:, None]) & s_ok[None, :]
        if HAS_COUNTED:
            visible = visible & (tl.load(counted_ptr + s, mask=s_ok, other=0) != 0)[None, :]
        score = tl.where(visible, acc, float("-inf"))
        packed = _pack(score, s.to(tl.int64)[None, :] + tl.zeros((BLOCK_T, KP), tl.int64))
        packed = tl.where(s_ok[None, :], packed, -9223372036854775808)
        block = tl.sort(packed, dim=1, descending=False)
        best = tl.sort(tl.maximum(best, block), dim=1, descending=True)
    row = 0xFFFFFFFF - (best & 0xFFFFFFFF)
    ordered = (best >> 32).to(tl.int32)
    val = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
    c = tl.arange(0, KP)
    out = b * so_b + t[:, None] * so_t + c[None, :]
    ok = t_ok[:, None] & (c < KK)[None, :]
    tl.store(rows_ptr + out, row, mask=ok)
    tl.store(vals_ptr + out, val, mask=ok)


def indexer_topk(q: torch.Tensor, key, weights: torch.Tensor, q_pos: torch.Tensor,
                 k_pos: torch.Tensor, k: int, block: int = 0,
                 counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/dsa.indexer_topk's contract (`block` is the twin's key block; the kernel's is k's power of two).
    `key`: a tensor or a (head, tail) pair of its rows (ops/dsa.py), read where they lie (no join)."""
    if k < 1:
        raise ValueError(f"index_topk={k}: must be >= 1")
    B, T, HI, DI = q.shape
    k0, k1 = (in_place(x) for x in key) if isinstance(key, tuple) else (in_place(key),) * 2
    k1 = k1.to(k0.dtype)
    S = rows_count(key)
    kk = min(k, S)
    rows = torch.empty(B, T, kk, dtype=torch.long, device=q.device)
    vals = torch.empty(B, T, kk, dtype=torch.float32, device=q.device)
    if T == 0 or kk == 0:
        return rows, vals
    q, weights = q.contiguous(), weights.contiguous()
    q_pos, k_pos = q_pos.contiguous(), k_pos.contiguous()
    cnt = counted.contiguous().to(torch.int8) if counted is not None else k_pos
    grid = (triton.cdiv(T, BT), B)
    _indexer_topk_kernel[grid](
        q, k0, k1, weights, q_pos, k_pos, cnt, rows, vals, T, S, k0.shape[1], HI, DI ** -0.5, kk,
        q.stride(0), q.stride(1), q.stride(2), *row_strides(k0), *row_strides(k1),
        weights.stride(0), weights.stride(1),
        rows.stride(0), rows.stride(1),
        DI=DI, DIP=pow2(DI), KP=pow2(k), BLOCK_T=BT, HAS_COUNTED=counted is not None,
        IEEE=q.dtype == torch.float32, num_warps=8 if k >= 1024 else 4)
    return rows, vals
