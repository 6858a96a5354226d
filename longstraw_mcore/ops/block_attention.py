"""Plain-torch blockwise attention kernels: one key set's forward partial and its backward given the
*merged* output and log-sum-exp (FlashAttention-2's algorithm without a fused kernel).

Shapes in the package legend (longstraw_mcore/__init__.py): T queries, S keys (GQA: Hq/Hk queries per
key head), b the key/query block. Positions are absolute: query i sits at `q_start + i`, key j at
`k_start + j`; key j is visible to query i iff `k_start + j <= q_start + i`.

`partial_forward` walks query blocks and, inside each, the key blocks it can see with an online
softmax (never a [T, S] score matrix): O(T * b) memory. With `store` it keeps each block's
unnormalised probabilities (relative to that block's running max) for the backward instead:
O(T * S) memory, one matmul per block pair less in the backward.

`partial_backward` recomputes each block's probabilities from the *global* log-sum-exp of the
attention this key set is part of, so that with the global row term delta = rowsum(dO * O) - dlse
    p_ij = exp(s_ij - lse_i),   ds_ij = p_ij (dO_i . v_j - delta_i)
    dq_i += scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i,   dv_j = sum_i p_ij dO_i
are this key set's exact share of the gradient of one softmax over the union of all key sets. A key
set whose keys/values are state (the prompt K/V in exact mode) passes `sink`: its dK/dV are added
block by block into those (>= float32) accumulators instead of being returned, so no full-size
gradient temporary exists. Key sets with batch 1 serve every query batch row (their gradient is
summed over the batch).

Models call the single entry point `ops.attention.attention`, which merges the partials of several
key sets (ops/attention_merge.py holds the merge maths).
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops.attention_merge import work_dtype


def _mask(T: int, nb: int, q_start: int, k0: int, device) -> torch.Tensor | None:
    """True where key (k0 + j) is *after* query (q_start + i); None when nothing is masked."""
    if k0 + nb - 1 <= q_start:
        return None
    qpos = q_start + torch.arange(T, device=device)[:, None]
    kpos = k0 + torch.arange(nb, device=device)[None, :]
    return kpos > qpos


def _blocks(T: int, S: int, q_start: int, k_start: int, block: int):
    """(t0, t1, s0, s1) for every (query block, key block) pair with at least one visible key."""
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        for s0 in range(0, S, block):
            if k_start + s0 > q_start + t1 - 1:
                break  # this and later key blocks are after every query of the block
            yield t0, t1, s0, min(S, s0 + block)


def _heads(x: torch.Tensor, s0: int, s1: int, rep: int, work) -> torch.Tensor:
    """Rows s0:s1 of keys/values [Bk, S, Hk, D] as [Bk, Hq, b, D] in the work dtype."""
    return x[:, s0:s1].to(work).transpose(1, 2).repeat_interleave(rep, 1)


def partial_forward(q, k, v, q_start: int, k_start: int, scale: float, block: int, store: bool):
    """One key set: (out [B,Hq,T,Dv] work dtype, lse [B,Hq,T] work dtype, kept or None).

    Rows that see no key get out = 0 and lse = -inf. `kept[(t0, s0)] = (p, m)` when `store`."""
    B, T, Hq, _ = q.shape
    S, Hk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = Hq // Hk
    work = work_dtype(q.dtype)
    qh = q.to(work).transpose(1, 2) * scale                                       # [B,Hq,T,D]
    out = torch.zeros(B, Hq, T, Dv, dtype=work, device=q.device)
    lse = torch.full((B, Hq, T), float("-inf"), dtype=work, device=q.device)
    kept = {} if store else None
    state = {}  # per query block: running max, sum, accumulator
    for t0, t1, s0, s1 in _blocks(T, S, q_start, k_start, block):
        if t0 not in state:
            state[t0] = (torch.full((B, Hq, t1 - t0), float("-inf"), dtype=work, device=q.device),
                         torch.zeros(B, Hq, t1 - t0, dtype=work, device=q.device),
                         torch.zeros(B, Hq, t1 - t0, Dv, dtype=work, device=q.device))
        m, lsum, acc = state[t0]
        sc = qh[:, :, t0:t1] @ _heads(k, s0, s1, rep, work).transpose(-1, -2)
        mk = _mask(t1 - t0, s1 - s0, q_start + t0, k_start + s0, q.device)
        if mk is not None:
            sc = sc.masked_fill(mk, float("-inf"))
        m_new = torch.maximum(m, sc.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - m_safe[..., None])
        corr = torch.exp(m - m_safe)
        state[t0] = (m_new, lsum * corr + p.sum(-1), acc * corr[..., None] + p @ _heads(v, s0, s1, rep, work))
        if store:
            kept[(t0, s0)] = (p, m_safe)
    for t0, (m, lsum, acc) in state.items():
        t1 = t0 + m.shape[-1]
        empty = lsum == 0
        ones = torch.ones_like(lsum)
        out[:, :, t0:t1] = acc / torch.where(empty, ones, lsum)[..., None]
        lse[:, :, t0:t1] = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, ones, lsum)))
    return out, lse, kept


def partial_backward(q, k, v, do, delta, lse, q_start: int, k_start: int, scale: float, block: int, kept,
                     need_q: bool, need_k: bool, need_v: bool, sink=None, sink_scale: float = 1.0):
    """This key set's share of the gradient, given the merged attention's lse and delta.

    do [B,Hq,T,Dv], delta / lse [B,Hq,T] (work dtype; lse the *merged* one). Returns (dq [B,Hq,T,D]
    work or None, dk, dv [Bk,Hk,S,*] work or None). With `sink = (acc_k, acc_v)` ([Bk, S, Hk, *],
    >= float32) dK/dV are added there block by block, times `sink_scale`, and (None, None) is
    returned for them."""
    B, T, Hq, D = q.shape
    Bk, S, Hk = k.shape[0], k.shape[1], k.shape[2]
    rep = Hq // Hk
    work = work_dtype(q.dtype)
    if sink is not None:
        assert Bk == 1 and sink[0].shape[:3] == (1, S, Hk) and sink[0].dtype in (torch.float32, torch.float64), \
            (k.shape, sink[0].shape, sink[0].dtype)
        need_k = need_v = True
    qh = q.to(work).transpose(1, 2)
    inf_rows = torch.isinf(lse)
    lse_safe = torch.where(inf_rows, torch.zeros_like(lse), lse)
    dq = torch.zeros_like(qh) if need_q else None
    dk = torch.zeros(Bk, Hk, S, D, dtype=work, device=q.device) if need_k and sink is None else None
    dv = torch.zeros(Bk, Hk, S, v.shape[-1], dtype=work, device=q.device) if need_v and sink is None else None

    def fold(x):  # [B, Hq, b, *] -> [Bk, Hk, b, *]: sum the query heads of each kv head (and the batch)
        x = x.reshape(B, Hk, rep, *x.shape[2:]).sum(2)
        return x.sum(0, keepdim=True) if Bk == 1 and B > 1 else x

    for t0, t1, s0, s1 in _blocks(T, S, q_start, k_start, block):
        kb, vb = _heads(k, s0, s1, rep, work), _heads(v, s0, s1, rep, work)
        if kept is not None:  # stored in forward (masked entries are already 0)
            p_blk, m_blk = kept[(t0, s0)]
            p = p_blk * torch.exp(m_blk - lse_safe[:, :, t0:t1])[..., None]
        else:
            p = torch.exp((qh[:, :, t0:t1] * scale) @ kb.transpose(-1, -2) - lse_safe[:, :, t0:t1, None])
            mk = _mask(t1 - t0, s1 - s0, q_start + t0, k_start + s0, q.device)
            if mk is not None:
                p = p.masked_fill(mk, 0.0)
        p = torch.where(inf_rows[:, :, t0:t1, None], torch.zeros_like(p), p)
        dob = do[:, :, t0:t1]
        ds = p * (dob @ vb.transpose(-1, -2) - delta[:, :, t0:t1, None])
        if need_q:
            dq[:, :, t0:t1] += (ds @ kb) * scale
        # Keys/values that are constants (detached prompt state) get no gradient: 2 of 5 matmuls skipped.
        if need_k:
            g = fold((ds.transpose(-1, -2) @ qh[:, :, t0:t1]) * scale)
            if sink is None:
                dk[:, :, s0:s1] += g
            else:
                sink[0][:, s0:s1] += (g.transpose(1, 2) * sink_scale if sink_scale != 1.0 else g.transpose(1, 2)).to(sink[0].device)
        if need_v:
            g = fold(p.transpose(-1, -2) @ dob)
            if sink is None:
                dv[:, :, s0:s1] += g
            else:
                sink[1][:, s0:s1] += (g.transpose(1, 2) * sink_scale if sink_scale != 1.0 else g.transpose(1, 2)).to(sink[1].device)
    return dq, dk, dv
