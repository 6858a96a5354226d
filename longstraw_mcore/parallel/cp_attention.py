"""Attention across context-parallel ranks: the prompt's K/V sharded by sequence, merged by log-sum-exp.

Both functions below are single autograd nodes built on the partial kernels of `ops/` (through the
same `kernel` seam as single-rank attention, ops/attention.py, so a fused kernel plugs in without
touching this file). Shapes (package legend): n CP ranks, T chunk tokens, R branch tokens, O / lse the softmax output and log-sum-exp over
the union of every rank's keys; delta = rowsum(dO * O) - dlse.

`replay_attention` (a branch, replicated on every CP rank). Rank r computes the branch queries'
partial over its shard of the prompt (plus, on rank 0 only, the branch's own causal keys: counted
once), then
    m = max_r lse_r,   O = sum_r exp(lse_r - m) O_r / sum_r exp(lse_r - m),   lse = m + log sum_r exp(lse_r - m)
by two all-reduces; every rank ends with the same O. Backward: dO is the same on every rank (all
that follows is replicated), so rank r computes its shard's share with the global lse and delta
(ring recipe): its state gradient (dK, dV of its shard) stays local, exactly once; the query gradient
is the sum of every shard's share (all-reduce), and so is the gradient of the branch's own K/V
(non-zero on rank 0 only): every replica then holds the full gradient of the replicated tensors.

`chunk_attention` (a capture or exact-mode recompute chunk, its tokens split across ranks by zig-zag
pieces). The chunk's Q, K, V are all-gathered (a chunk's worth, independent of the prompt length);
rank r computes every chunk query against its shard of the earlier chunks' state (no mask: all of it
precedes the chunk) and its own queries against the chunk's keys (causal; zig-zag balances this),
merges, and the n partials of every row are merged across ranks as above; each rank keeps its rows.
Backward: dO and delta of every row are all-gathered; each rank's shard gives its share of dQ for
every row (summed over ranks) and its state gradient (added into the state's accumulators with the
set's `grad_scale`); its own queries give dQ of its rows and dK, dV of every chunk key (summed over
ranks, each rank keeping its rows). Per-rank compute of the state part is exactly 1/n (every rank
holds 1/n of the state and sees every query).
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops.attention import KeySet, kernel
from longstraw_mcore.ops.attention_merge import backward_terms, merge_partials, unpack_saved, work_dtype
from longstraw_mcore.parallel.cp import CPLayout, rank_pieces
from longstraw_mcore.parallel.cp_comm import all_reduce_sum, gather_tokens, local_rows, merge_ranks


class _ReplayAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cfg, *kv):
        q_start, scale, block, layout, sets = cfg  # sets: (start, sink, sink_scale, shared) per key set
        kern = kernel(q)
        work = work_dtype(q.dtype)
        B, T, Hq, _ = q.shape
        active = [j for j, (_, _, _, shared) in enumerate(sets) if not shared or layout.rank == 0]
        parts = [kern.partial_forward(q, kv[2 * j], kv[2 * j + 1], q_start, sets[j][0], scale, block, False)[:2]
                 for j in active]
        o, lse = merge_partials(parts, (B, Hq, T, kv[1].shape[-1]), work, q.device)
        out, lse = merge_ranks(o, lse, layout)
        out = out.transpose(1, 2).to(q.dtype)
        lse = lse.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, *kv, out, lse)
        ctx.cfg, ctx.active = cfg, active
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q_start, scale, block, layout, sets = ctx.cfg
        n = len(sets)
        q, kv, out, lse, _ = unpack_saved(ctx.saved_tensors, n)
        work = work_dtype(q.dtype)
        do, delta, lse_h = backward_terms(dout, dlse, out, lse, work)
        kern = kernel(q)
        dq = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=work, device=q.device)
        grads = [None] * (2 * n)
        for j in ctx.active:
            start, sink, sink_scale, shared = sets[j]
            need = (ctx.needs_input_grad[2 + 2 * j], ctx.needs_input_grad[3 + 2 * j])
            dqj, dk, dv = kern.partial_backward(q, kv[2 * j], kv[2 * j + 1], do, delta, lse_h, q_start, start,
                                                scale, block, None, True, need[0] or shared, need[1] or shared,
                                                sink=sink, sink_scale=sink_scale)
            dq += dqj
            if dk is not None:
                grads[2 * j], grads[2 * j + 1] = dk.transpose(1, 2), dv.transpose(1, 2)
        for j, (_, _, _, shared) in enumerate(sets):  # replicated keys: every replica gets the full gradient
            if shared:
                k, v = kv[2 * j], kv[2 * j + 1]
                dk = grads[2 * j] if grads[2 * j] is not None else torch.zeros(k.shape, dtype=work, device=k.device)
                dv = grads[2 * j + 1] if grads[2 * j + 1] is not None else torch.zeros(v.shape, dtype=work,
                                                                                       device=v.device)
                grads[2 * j], grads[2 * j + 1] = all_reduce_sum(dk, layout), all_reduce_sum(dv, layout)
        grads = [None if g is None else g.to(kv[i].dtype) for i, g in enumerate(grads)]
        dq = all_reduce_sum(dq, layout).transpose(1, 2).to(q.dtype)
        return (dq if ctx.needs_input_grad[0] else None, None, *grads)


def replay_attention(q, local_sets: list[KeySet], shared_sets: list[KeySet], q_start: int, layout: CPLayout,
                     scale: float | None = None, block: int = 1024):
    """Replicated queries q [B,R,Hq,D] over this rank's `local_sets` (its prompt shard; gradients stay
    local) and `shared_sets` (identical on every rank, counted once): (out, lse), the same on every rank."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    sets = tuple((int(ks.start), ks.grad, float(ks.grad_scale), False) for ks in local_sets) + \
        tuple((int(ks.start), None, 1.0, True) for ks in shared_sets)
    kv = [t for ks in (*local_sets, *shared_sets) for t in (ks.k, ks.v)]
    return _ReplayAttention.apply(q, (int(q_start), scale, int(block), layout, sets), *kv)


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, *prior):
        s0, T, scale, block, layout, prior_cfg = cfg
        kern = kernel(q)
        work = work_dtype(q.dtype)
        Qf, Kf, Vf = (gather_tokens(x, layout, T) for x in (q, k, v))
        B, _, Hq, _ = Qf.shape
        Dv = v.shape[-1]
        parts = []
        if prior:
            parts.append(kern.partial_forward(Qf, prior[0], prior[1], s0, 0, scale, block, False)[:2])
        own_o = torch.zeros(B, Hq, T, Dv, dtype=work, device=q.device)
        own_lse = torch.full((B, Hq, T), float("-inf"), dtype=work, device=q.device)
        for a, b in rank_pieces(T, layout.size, layout.rank):
            if b > a:
                o, l, _ = kern.partial_forward(Qf[:, a:b], Kf, Vf, s0 + a, s0, scale, block, False)
                own_o[:, :, a:b], own_lse[:, :, a:b] = o, l
        parts.append((own_o, own_lse))
        o, lse = merge_partials(parts, (B, Hq, T, Dv), work, q.device)
        O, LSE = merge_ranks(o, lse, layout)                                    # [B,Hq,T,*], every row
        ctx.save_for_backward(q, k, v, O, LSE, *prior)
        ctx.cfg = cfg
        out = local_rows(O.transpose(1, 2), layout, T).to(q.dtype)
        return out, local_rows(LSE.transpose(1, 2), layout, T).contiguous()

    @staticmethod
    def backward(ctx, dout, dlse):
        s0, T, scale, block, layout, prior_cfg = ctx.cfg
        q, k, v, O, LSE, *prior = ctx.saved_tensors
        kern = kernel(q)
        work = work_dtype(q.dtype)
        O_loc = local_rows(O.transpose(1, 2), layout, T)                          # [B,S_r,Hq,Dv] work
        do_loc = (torch.zeros_like(O_loc) if dout is None else dout.to(work))
        delta_loc = (do_loc * O_loc).sum(-1)
        if dlse is not None:
            delta_loc = delta_loc - dlse.to(work)
        dO = gather_tokens(do_loc, layout, T).transpose(1, 2)                     # [B,Hq,T,Dv]
        delta = gather_tokens(delta_loc, layout, T).transpose(1, 2)               # [B,Hq,T]
        Qf, Kf, Vf = (gather_tokens(x, layout, T) for x in (q, k, v))
        B, _, Hq, D = Qf.shape
        dQ = torch.zeros(B, Hq, T, D, dtype=work, device=q.device)
        if prior:
            sink, sink_scale = prior_cfg
            dQp, _, _ = kern.partial_backward(Qf, prior[0], prior[1], dO, delta, LSE, s0, 0, scale, block, None,
                                              True, False, False, sink=sink, sink_scale=sink_scale)
            dQ += dQp  # every rank's shard contributes to every row: summed below
        dK = torch.zeros(B, Kf.shape[2], T, D, dtype=work, device=q.device)
        dV = torch.zeros(B, Vf.shape[2], T, Vf.shape[-1], dtype=work, device=q.device)
        for a, b in rank_pieces(T, layout.size, layout.rank):
            if b > a:
                dq, dk, dv = kern.partial_backward(Qf[:, a:b], Kf, Vf, dO[:, :, a:b], delta[:, :, a:b],
                                                   LSE[:, :, a:b], s0 + a, s0, scale, block, None, True, True, True)
                dQ[:, :, a:b] += dq
                dK += dk
                dV += dv
        dQ, dK, dV = (all_reduce_sum(x, layout) for x in (dQ, dK, dV))
        dq, dk, dv = (local_rows(x.transpose(1, 2), layout, T).to(t.dtype) for x, t in ((dQ, q), (dK, k), (dV, v)))
        return dq, dk, dv, None, *([None] * len(prior))


def chunk_attention(q, k, v, prior: KeySet | None, s0: int, T: int, layout: CPLayout, scale: float | None = None,
                    block: int = 1024):
    """This rank's zig-zag pieces of a chunk [s0, s0 + T): q/k/v [B, S_r, H, D] -> (out, lse) of its rows
    over the chunk's keys (causal) and the earlier state (`prior`: this rank's shard of it)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    has_prior = prior is not None and prior.k.shape[1] > 0
    prior_cfg = (prior.grad, float(prior.grad_scale)) if has_prior else None
    args = (prior.k, prior.v) if has_prior else ()
    return _ChunkAttention.apply(q, k, v, (int(s0), int(T), scale, int(block), layout, prior_cfg), *args)
