"""The DSA indexer's scores as one Triton kernel, behind the contract of ops/dsa.py's `indexer_topk`:

    indexer_topk(q, key, weights, q_pos, k_pos, k, block, counted) -> (rows [B, T, min(k, S)], scores, -inf invalid)

The kernel (grid: query tiles of BT x key tiles of BS x batch) forms one tile of the scores
I[t, s] = sum_h w[t, h] ReLU(q[t, h] . key[s]) Di^-0.5 in float32 (dots with float32 accumulation, IEEE
float32 for float32 inputs: no TF32), keys after the query -inf, and writes it into the block's scores
[B, T, block]. The per-head scores [T, Hi, block] that the twin forms (ops/dsa.indexer_scores: 2 Hi + 1
float32 values per query and key, 65 for GLM-5.2) never exist; a program holds [BT, BS] in registers.

The selection is the twin's own code (ops/dsa.topk_over_blocks: a running best k merged with each key
block by a stable sort, ties toward the earlier position), so the kernel and the twin choose the same rows
wherever their scores are equal. (A first version kept the running best k in registers and merged it by a
bitonic sort per key block: at GLM-5.2's top-k of 2,048 that is [16, 2,048] int64 per program, and on an
H200 its test at 6,144 keys did not finish within 190 s: bench_results/h200_gpu_check_20261205.)

The keys may come in two parts (the prompt state's rows, then the call's own: ops/dsa.py), read where
they lie: the copy that joins them is never made.

Dtypes: float32, bf16, fp16 queries and keys (the scores in float32 either way); float64 is the twin's
(ops/dispatch.dsa_kernel). Memory: the block's scores and the running best, O(B T (block + k)) float32 and
int64, as the twin's less its per-head scores. The index keys are read in the model dtype: the prompt state
keeps them unrounded under memory.state_dtype=fp8 (prompt_state/mla.py `exact_rows`: fp8 index keys moved
the gradient to cosine 0.887), so there is no fp8 path to read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw_mcore.ops.dsa import rows_count, topk_over_blocks
from longstraw_mcore.ops.dsa_triton_common import in_place, pow2, row_strides

BT = 64  # queries per program
BS = 64  # keys per program
BLOCK = 16384
"""Key rows per selection step when the caller names none: the sort's share of the work is (block + k) /
block of the scores' (1.125 at GLM-5.2's top-k of 2,048)."""


@triton.jit
def _scores_kernel(q_ptr, k0_ptr, k1_ptr, w_ptr, qpos_ptr, kpos_ptr, out_ptr,
                   T, A, NB, N0, HI, scale,
                   sq_b, sq_t, sq_h, sk0_b, sk0_s, sk1_b, sk1_s, sw_b, sw_t, so_b, so_t,
                   DI: tl.constexpr, DIP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                   IEEE: tl.constexpr):
    """Scores of queries [pid_t BT, +BT) to key rows A + [pid_s BS, +BS) (of NB in this block) -> out."""
    pid_t, pid_s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    j = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)         # column in this block
    j_ok = j < NB
    s = A + j                                            # key row
    d = tl.arange(0, DIP)
    d_ok = d < DI
    in0, in1 = j_ok & (s < N0), j_ok & (s >= N0)         # the key's two parts (head rows, then tail rows)
    keys = (tl.load(k0_ptr + b * sk0_b + s[:, None] * sk0_s + d[None, :], mask=in0[:, None] & d_ok[None, :],
                    other=0.0)
            + tl.load(k1_ptr + b * sk1_b + (s - N0)[:, None] * sk1_s + d[None, :], mask=in1[:, None] & d_ok[None, :],
                      other=0.0))
    acc = tl.zeros((BLOCK_T, BLOCK_S), tl.float32)
    for h in range(HI):
        qh = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + h * sq_h + d[None, :],
                     mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            dots = tl.dot(qh, tl.trans(keys), input_precision="ieee")
        else:
            dots = tl.dot(qh, tl.trans(keys))
        wh = tl.load(w_ptr + b * sw_b + t * sw_t + h, mask=t_ok, other=0.0).to(tl.float32)
        acc += wh[:, None] * tl.maximum(dots * scale, 0.0)
    qpos = tl.load(qpos_ptr + t, mask=t_ok, other=0)
    kpos = tl.load(kpos_ptr + s, mask=j_ok, other=0)
    score = tl.where(kpos[None, :] <= qpos[:, None], acc, float("-inf"))
    tl.store(out_ptr + b * so_b + t[:, None] * so_t + j[None, :], score, mask=t_ok[:, None] & j_ok[None, :])


def indexer_scores(q: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """The scores [B, T, b - a] (float32) of the queries to key rows [a, b) of the two-part key (k0: rows
    [0, len k0), k1: the rest; the same tensor twice for one part). `q`, `weights` contiguous."""
    B, T, HI, DI = q.shape
    out = torch.empty(B, T, b - a, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(b - a, BS), B)
    _scores_kernel[grid](
        q, k0, k1, weights, q_pos, k_pos, out, T, a, b - a, k0.shape[1], HI, DI ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), *row_strides(k0), *row_strides(k1),
        weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
        DI=DI, DIP=pow2(DI), BLOCK_T=BT, BLOCK_S=BS, IEEE=q.dtype == torch.float32, num_warps=4)
    return out


def indexer_topk(q: torch.Tensor, key, weights: torch.Tensor, q_pos: torch.Tensor,
                 k_pos: torch.Tensor, k: int, block: int = 0,
                 counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/dsa.indexer_topk's contract (`block`: key rows per selection step, 0 for BLOCK). `key`: a tensor
    or a (head, tail) pair of its rows (ops/dsa.py), read where they lie (no join)."""
    if k < 1:
        raise ValueError(f"index_topk={k}: must be >= 1")
    B, T = q.shape[:2]
    k0, k1 = (in_place(x) for x in key) if isinstance(key, tuple) else (in_place(key),) * 2
    k1 = k1.to(k0.dtype)
    S = rows_count(key)
    if T == 0 or S == 0:
        kk = min(k, S)
        return (torch.empty(B, T, kk, dtype=torch.long, device=q.device),
                torch.empty(B, T, kk, dtype=torch.float32, device=q.device))
    q, weights = q.contiguous(), weights.contiguous()
    q_pos, k_pos = q_pos.contiguous(), k_pos.contiguous()
    return topk_over_blocks(lambda a, b: indexer_scores(q, k0, k1, weights, q_pos, k_pos, a, b), S, k,
                            block or BLOCK, counted)
