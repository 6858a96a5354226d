"""DeepSeek Sparse Attention over a prompt state sharded by sequence (GLM-5.x): across context-parallel
ranks, and inside the tensor-parallel group (one latent serves every head, so TP ranks do not replicate
it: each keeps a stripe of the rows, ARCHITECTURE.md section 4). The top-k is chosen globally, the
attention merged by log-sum-exp, one level per group (TP, then CP).

Inside the TP group a rank's queries are its heads: they are gathered over the group (`GatherHeads`:
every rank then attends all heads to its stripe; backward sums the query gradient over the group and
keeps its heads), merged over the group, and each rank keeps its heads (`LocalHeads`: backward gathers
the heads' gradients, so every rank holds the whole output gradient, as the merge's identity backward
requires).

Shapes (package legend): n ranks of a level, k index_topk, T queries, S keys, R kv_lora_rank. Each
rank holds its keys (its shard of the prompt state; in a capture / recompute chunk also its zig-zag
pieces of the chunk's keys; in a replayed branch the branch's own keys, counted on rank 0 only) with
their global positions.

    selection   every rank scores the queries against its keys and proposes its top k as
                (score, position); the n k proposals are all-gathered and every rank takes the best k
                with the same tie-break as one rank (equal scores: the earlier position), so the
                selection is the single-rank one, identical on every rank
    attention   rank r attends every query to the selected keys it holds: (o_r, lse_r) in latent space;
                o = sum_r exp(lse_r - m) o_r / sum_r exp(lse_r - m) by two all-reduces, then W_UV

Gradients: the all-reduce of the merge hands every rank the full gradient of o (backward identity),
so rank r's keys get their gradient from rank r alone, exactly once. Queries (and the weights used in
the partial attention) are replicated in a replayed branch: their gradient is summed over the ranks
(`copy_to` regions). A chunk's queries are gathered from their owners (`GatherTokens`: backward sums
over ranks and returns each owner its rows) and the merged output split back (`LocalRows`: backward
gathers the rows' gradients), so each rank's parameter gradients cover its own tokens, as for the
hybrid family's chunks (prompt_state/contexts.py).

`attend_latent_sharded` is the whole layer-side computation behind the contexts' `attend_latent` hook
(prompt_state/hooks.py) when the state is sharded: the mixer hands over its queries and never sees
the layout.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from longstraw_mcore.ops.dispatch import dsa_kernel
from longstraw_mcore.parallel.cp import CPLayout
from longstraw_mcore.parallel.cp_comm import GatherHeads, GatherTokens, LocalHeads, LocalRows, gather_tokens, lse_merge


def cp_select(vals: torch.Tensor, pos: torch.Tensor, k: int, layout):
    """This rank's proposals (scores [B, T, k_r] of its best keys, -inf invalid; their global positions)
    -> (positions [B, T, k], scores [B, T, k], -inf invalid): the top-k over the ranks of `layout` (a
    CPLayout or a TP group), the same on every rank; applied level by level it gives the global top-k."""
    B, T, kl = vals.shape
    if kl < k:  # pad every rank's proposal to k (padding is invalid)
        vals = torch.cat([vals, vals.new_full((B, T, k - kl), float("-inf"))], -1)
        pos = torch.cat([pos, pos.new_zeros((B, T, k - kl))], -1)
    every_v = [torch.empty_like(vals) for _ in range(layout.size)]
    every_p = [torch.empty_like(pos) for _ in range(layout.size)]
    dist.all_gather(every_v, vals.contiguous(), group=layout.group)
    dist.all_gather(every_p, pos.contiguous(), group=layout.group)
    return merge_proposals(torch.cat(every_v, -1), torch.cat(every_p, -1), k)


def merge_proposals(vals: torch.Tensor, pos: torch.Tensor, k: int):
    """The ranks' proposals side by side (scores [B, T, n k], -inf invalid; global positions) -> the best k
    (positions, scores): best first, ties to the earlier position (order by position, then a stable sort
    by score)."""
    by_pos = torch.sort(torch.where(vals > float("-inf"), pos, torch.iinfo(pos.dtype).max), dim=-1,
                        stable=True).indices
    vals, pos = torch.gather(vals, -1, by_pos), torch.gather(pos, -1, by_pos)
    best = torch.sort(-vals, dim=-1, stable=True).indices[..., :k]
    return torch.gather(pos, -1, best), torch.gather(vals, -1, best)


def sharded_mla_sparse(q_nope, q_pe, c_kv, k_pe, key_pos, counted, w_uk, sel_pos, valid, scale: float,
                       levels: list, query_block: int = 0) -> torch.Tensor:
    """The sparse MLA of every query over the selected keys, each rank over those it holds (`counted`
    [S_r] bool: the rows it counts; None = all), merged over `levels` (groups, innermost first): the
    attention output in latent space [B, T, H, R], the same on every rank of the groups (the caller
    applies W_UV: on its own rows and heads, so that W_UV's gradient covers each once)."""
    size = int(key_pos.max()) + 1 if key_pos.numel() else 1
    lookup = torch.full((size + 1,), -1, dtype=torch.long, device=key_pos.device)
    rows = torch.arange(key_pos.shape[0], device=key_pos.device)
    if counted is not None:
        rows, kp = rows[counted], key_pos[counted]
    else:
        kp = key_pos
    lookup[kp] = rows
    loc = lookup[sel_pos.clamp(0, size)]
    mine = valid & (loc >= 0)
    kernel = dsa_kernel(q_nope, "dsa_attention")
    o, lse = kernel.mla_sparse_partial(q_nope, q_pe, c_kv, k_pe, w_uk, loc.clamp(min=0), mine, scale, query_block)
    for group in levels:
        o, lse = lse_merge(o, lse, group)
    return o


def attend_latent_sharded(query, keys, own, tp_group, kv, layout: CPLayout | None, chunk: tuple[int, int] | None):
    """The `attend_latent` hook over a prompt state sharded by sequence: over the TP group (`kv`: its
    stripes) and/or the CP ranks (`layout`). `query`: the layer's `LatentQuery` (this rank's rows and
    heads), `keys` / `own`: `MLAKeys` (this rank's keys; the call's own latents); `chunk`: (T, s0) when
    the call's tokens are this CP rank's zig-zag rows of a chunk (gathered to the whole chunk here),
    None for a branch, whole on every CP rank. Inside the TP group every rank takes every head's
    queries and keeps its heads' output. Returns (out [B, T_r, h, Dv], the selection: global positions,
    valid) for this rank's rows and heads."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as copy_to

    levels = [g for g in (kv, layout) if g is not None]
    q_nope, q_pe, w_uk, q_pos = query.q_nope, query.q_pe, query.w_uk, query.pos
    if chunk is not None:  # this rank's rows of a chunk -> the whole chunk
        T, s0 = chunk
        q_nope, q_pe = GatherTokens.apply(q_nope, layout, T), GatherTokens.apply(q_pe, layout, T)
        q_pos = s0 + torch.arange(T, device=q_pos.device)
    elif layout is not None:  # replicated queries and W_UK in a per-rank partial: gradients sum over CP
        q_nope, q_pe, w_uk = (copy_to(t, group=layout.group) for t in (q_nope, q_pe, w_uk))
    if kv is not None:  # every head's queries against this TP rank's stripe of the keys
        q_nope, q_pe = GatherHeads.apply(q_nope, kv), GatherHeads.apply(q_pe, kv)
        w_uk = GatherHeads.apply(w_uk[None, None], kv)[0, 0]
    selection = query.selection
    if query.index is not None and query.pool is not None:  # pooled indexer: pools replicated on every rank
        from longstraw_mcore.ops.dsa_pool import pooled_selection_of

        qi, wi = query.index
        if chunk is not None:
            qi, wi = gather_tokens(qi, layout, chunk[0]), gather_tokens(wi, layout, chunk[0])
        selection = pooled_selection_of(dataclasses.replace(query, index=(qi, wi), pos=q_pos), keys)
    elif query.index is not None:
        with torch.no_grad():
            qi, wi = query.index
            if chunk is not None:
                qi, wi = gather_tokens(qi, layout, chunk[0]), gather_tokens(wi, layout, chunk[0])
            kernel = dsa_kernel(qi, "dsa_indexer")
            kr, vals = kernel.indexer_topk(qi, keys.ik, wi, q_pos, keys.pos, query.topk, query.block, keys.counted)
            sel = keys.pos[kr]
            for g in levels:
                sel, vals = cp_select(vals, sel, query.topk, g)
            selection = (sel, vals > float("-inf"))
    sel, valid = selection
    c, k_pe = keys.c, keys.pe
    if kv is not None and torch.is_grad_enabled():
        # the call's own latents are computed on every TP rank: their gradient sums over the group
        # (the state rows are each rank's own stripe: theirs stays local). Keys arrive as (state, own)
        # row pairs from the prompt state (prompt_state/mla.py), or whole (a capture chunk's buffer)
        n = own.c.shape[1]

        def own_rows_summed(x):
            if isinstance(x, tuple):
                assert x[1].shape[1] == n, (x[1].shape, n)
                return x[0], copy_to(x[1], group=tp_group)
            return torch.cat([x[:, :-n], copy_to(x[:, -n:], group=tp_group)], 1)

        c, k_pe = own_rows_summed(c), own_rows_summed(k_pe)
    o_lat = sharded_mla_sparse(q_nope, q_pe, c, k_pe, keys.pos, keys.counted, w_uk, sel, valid, query.scale, levels,
                               query.query_block)
    if kv is not None:
        o_lat = LocalHeads.apply(o_lat, kv)
    if chunk is not None:
        o_lat = LocalRows.apply(o_lat, layout, chunk[0])
    return torch.einsum("bthr,hvr->bthv", o_lat, query.w_uv), selection
