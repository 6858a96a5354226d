"""Blockwise softmax attention returning (out, lse), memory-bounded in both directions.

Legend: B batch, T queries, S keys, Hq query heads, Hk key/value heads (GQA: Hq/Hk queries per key
head), D head dim. Positions are absolute: query i sits at `q_start + i`, key j at `k_start + j`;
key j is visible to query i iff `k_start + j <= q_start + i` (causal; all earlier-prompt keys are
visible to later queries).

Forward walks the keys in blocks of `block` with an online softmax (never a [T, S] score matrix);
backward recomputes each block's probabilities from the saved log-sum-exp (FlashAttention-2's
algorithm in plain torch), so memory is O(T * block) either way. With `store_probs` the forward keeps
each block's (unnormalised) probabilities instead, O(T * S) memory, and the backward skips the score
recompute (one of its three matmuls per block when the keys are constants): the FLOP-minimal choice
for a short branch against a prompt whose probabilities fit in memory. It returns the log-sum-exp as a
differentiable output: attention over several key sets (prompt state, the branch itself, other CP
ranks' shards) is one softmax over their union, obtained by `merge_attention` from per-set
(out, lse) pairs. With lse differentiable, gradients w.r.t. every set's keys and values (the
prompt-state gradients of exact mode) come out exact.

    ds_ij = p_ij * (dout_i . v_j - (dout_i . out_i - dlse_i))
"""

from __future__ import annotations

import torch


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mask(T: int, nb: int, q_start: int, k0: int, device) -> torch.Tensor | None:
    """True where key (k0 + j) is *after* query (q_start + i); None when nothing is masked."""
    if k0 + nb - 1 <= q_start:
        return None
    qpos = q_start + torch.arange(T, device=device)[:, None]
    kpos = k0 + torch.arange(nb, device=device)[None, :]
    return kpos > qpos


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_start: int, k_start: int, scale: float, block: int, store: bool):
        B, T, Hq, D = q.shape
        S, Hk = k.shape[1], k.shape[2]
        rep = Hq // Hk
        work = _work(q.dtype)
        qh = q.to(work).transpose(1, 2) * scale                                   # [B,Hq,T,D]
        m = torch.full((B, Hq, T), float("-inf"), dtype=work, device=q.device)
        lsum = torch.zeros(B, Hq, T, dtype=work, device=q.device)
        acc = torch.zeros(B, Hq, T, v.shape[-1], dtype=work, device=q.device)
        kept = [] if store else None  # (p, the running max it is relative to) per block
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            if k_start + s0 > q_start + T - 1:
                break  # this and later blocks are after every query
            kb = k[:, s0:s1].to(work).transpose(1, 2).repeat_interleave(rep, 1)   # [B,Hq,b,D]
            vb = v[:, s0:s1].to(work).transpose(1, 2).repeat_interleave(rep, 1)
            sc = qh @ kb.transpose(-1, -2)
            mk = _mask(T, s1 - s0, q_start, k_start + s0, q.device)
            if mk is not None:
                sc = sc.masked_fill(mk, float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(sc - m_safe[..., None])
            corr = torch.exp(m - m_safe)
            lsum = lsum * corr + p.sum(-1)
            acc = acc * corr[..., None] + p @ vb
            m = m_new
            if store:
                kept.append((p, m_safe))
        empty = lsum == 0
        out = acc / torch.where(empty, torch.ones_like(lsum), lsum)[..., None]
        lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(torch.where(empty, torch.ones_like(lsum), lsum)))
        out = out.transpose(1, 2).to(q.dtype)                                     # [B,T,Hq,D]
        lse = lse.transpose(1, 2).contiguous()                                    # [B,T,Hq]
        # Stored probabilities are saved tensors too: freed by the backward unless retain_graph.
        ctx.store = store
        ctx.save_for_backward(q, k, v, out, lse, *([t for pair in kept for t in pair] if store else []))
        ctx.cfg = (q_start, k_start, scale, block)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *flat = ctx.saved_tensors
        q_start, k_start, scale, block = ctx.cfg
        kept = list(zip(flat[0::2], flat[1::2])) if ctx.store else None
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        B, T, Hq, D = q.shape
        S, Hk = k.shape[1], k.shape[2]
        rep = Hq // Hk
        work = _work(q.dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is None:
            dlse = torch.zeros_like(lse)
        qh = q.to(work).transpose(1, 2)
        do = dout.to(work).transpose(1, 2)                                        # [B,Hq,T,D]
        lse_h = lse.to(work).transpose(1, 2)                                      # [B,Hq,T]
        lse_safe = torch.where(torch.isinf(lse_h), torch.zeros_like(lse_h), lse_h)
        Dv = (do * out.to(work).transpose(1, 2)).sum(-1) - dlse.to(work).transpose(1, 2)
        dq = torch.zeros_like(qh)
        dk = torch.zeros(B, Hk, S, D, dtype=work, device=q.device)
        dv = torch.zeros(B, Hk, S, v.shape[-1], dtype=work, device=q.device)
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            if k_start + s0 > q_start + T - 1:
                break
            kb = k[:, s0:s1].to(work).transpose(1, 2).repeat_interleave(rep, 1)
            vb = v[:, s0:s1].to(work).transpose(1, 2).repeat_interleave(rep, 1)
            if kept is not None:  # stored in forward (masked entries are already 0)
                p_blk, m_blk = kept[s0 // block]
                p = p_blk * torch.exp(m_blk - lse_safe)[..., None]
            else:
                sc = (qh * scale) @ kb.transpose(-1, -2)
                p = torch.exp(sc - lse_safe[..., None])
                mk = _mask(T, s1 - s0, q_start, k_start + s0, q.device)
                if mk is not None:
                    p = p.masked_fill(mk, 0.0)
            p = torch.where(torch.isinf(lse_h)[..., None], torch.zeros_like(p), p)
            dp = do @ vb.transpose(-1, -2)
            ds = p * (dp - Dv[..., None])
            if need_q:
                dq += (ds @ kb) * scale
            nb = s1 - s0
            # Keys/values that are constants (detached prompt state) get no gradient: skip 2 of 5 matmuls.
            if need_k:
                dk[:, :, s0:s1] = ((ds.transpose(-1, -2) @ qh) * scale).reshape(B, Hk, rep, nb, D).sum(2)
            if need_v:
                dv[:, :, s0:s1] = (p.transpose(-1, -2) @ do).reshape(B, Hk, rep, nb, -1).sum(2)
        return (dq.transpose(1, 2).to(q.dtype) if need_q else None,
                dk.transpose(1, 2).to(k.dtype) if need_k else None,
                dv.transpose(1, 2).to(v.dtype) if need_v else None, None, None, None, None, None)


def block_attention(q, k, v, q_start: int, k_start: int, scale: float | None = None, block: int = 1024,
                    store_probs: bool = False):
    """(out [B,T,Hq,D], lse [B,T,Hq]) of q against keys k/v [B,S,Hk,D] at the given absolute starts.

    Rows that see no key get out = 0 and lse = -inf (they drop out of `merge_attention`).
    `store_probs`: keep the probabilities for the backward (B*Hq*T*S values in >= float32) instead of
    recomputing the scores there; only meaningful under autograd."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} not a multiple of key heads {k.shape[2]}")
    T = q.shape[1]
    store = bool(store_probs and torch.is_grad_enabled())
    if T <= block:
        return _BlockAttention.apply(q, k, v, int(q_start), int(k_start), float(scale), int(block), store)
    # Query blocks too: each only walks the key blocks it can see, so a causal set costs ~T^2/2, not T^2.
    outs, lses = [], []
    for t0 in range(0, T, block):
        o, lse = _BlockAttention.apply(q[:, t0:t0 + block], k, v, int(q_start + t0), int(k_start), float(scale),
                                       int(block), store)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax over the union of key sets from per-set (out [B,T,H,D], lse [B,T,H]); differentiable."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])                                # [n,B,T,H]
    total = torch.logsumexp(lses, dim=0)
    total_safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = 0
    for o, lse in parts:
        w = torch.exp(lse - total_safe)
        out = out + o * w[..., None].to(o.dtype)
    return out
