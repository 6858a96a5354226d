"""DeepSeek Sparse Attention over a prompt state sharded by sequence (GLM-5.x): across context-parallel
ranks, and inside the tensor-parallel group (one latent serves every head, so TP ranks do not replicate
it: each keeps a stripe of the rows, ARCHITECTURE.md section 4). The top-k is chosen globally, the
attention merged by log-sum-exp, one level per group (TP, then CP).

Inside the TP group a rank's queries are its heads: they are gathered over the group (`GatherHeads`:
every rank then attends all heads to its stripe; backward sums the query gradient over the group and
keeps its heads), merged over the group, and each rank keeps its heads (`LocalHeads`: backward gathers
the heads' gradients, so every rank holds the whole output gradient, as the merge's identity backward
requires).

Legend: n CP ranks, k index_topk, S queries, R kv_lora_rank. Each rank holds its keys (its shard of
the prompt state; in a capture / recompute chunk also its zig-zag pieces of the chunk's keys; in a
replayed branch the branch's own keys, counted on rank 0 only) with their global positions.

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw_mcore.ops.dsa import mla_sparse_partial
from longstraw_mcore.parallel.cp import CPLayout
from longstraw_mcore.parallel.cp_comm import _own_heads, all_reduce_sum, gather_dim, gather_tokens, local_rows


class GatherTokens(torch.autograd.Function):
    """This rank's zig-zag rows [B, S_r, ...] -> the whole chunk [B, T, ...] on every rank."""

    @staticmethod
    def forward(ctx, x, layout: CPLayout, T: int):
        ctx.layout, ctx.T = layout, T
        return gather_tokens(x, layout, T)

    @staticmethod
    def backward(ctx, g):
        return local_rows(all_reduce_sum(g.clone(), ctx.layout), ctx.layout, ctx.T), None, None


class LocalRows(torch.autograd.Function):
    """The whole chunk [B, T, ...] (the same on every rank) -> this rank's rows [B, S_r, ...]."""

    @staticmethod
    def forward(ctx, x, layout: CPLayout, T: int):
        ctx.layout, ctx.T = layout, T
        return local_rows(x, layout, T)

    @staticmethod
    def backward(ctx, g):
        return gather_tokens(g.contiguous(), ctx.layout, ctx.T), None, None


class GatherHeads(torch.autograd.Function):
    """[B, S, h, ...] this rank's heads -> [B, S, h n, ...] every head of the group (`group`: anything
    with .group / .rank / .size; heads in rank order, as Megatron's column-parallel split lays them)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.grp = group
        return gather_dim(x, group, 2)

    @staticmethod
    def backward(ctx, g):
        return _own_heads(all_reduce_sum(g.clone(), ctx.grp), ctx.grp).contiguous(), None


class LocalHeads(torch.autograd.Function):
    """[B, S, H, ...] every head (the same on every rank of the group) -> this rank's [B, S, H/n, ...]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.grp = group
        return _own_heads(x, group).contiguous()

    @staticmethod
    def backward(ctx, g):
        return gather_dim(g.contiguous(), ctx.grp, 2), None


def cp_select(vals: torch.Tensor, pos: torch.Tensor, k: int, layout):
    """This rank's proposals (scores [B, S, k_r] of its best keys, -inf invalid; their global positions)
    -> (positions [B, S, k], scores [B, S, k], -inf invalid): the top-k over the ranks of `layout` (a
    CPLayout or a TP group), the same on every rank; applied level by level it gives the global top-k."""
    B, S, kl = vals.shape
    if kl < k:  # pad every rank's proposal to k (padding is invalid)
        vals = torch.cat([vals, vals.new_full((B, S, k - kl), float("-inf"))], -1)
        pos = torch.cat([pos, pos.new_zeros((B, S, k - kl))], -1)
    every_v = [torch.empty_like(vals) for _ in range(layout.size)]
    every_p = [torch.empty_like(pos) for _ in range(layout.size)]
    dist.all_gather(every_v, vals.contiguous(), group=layout.group)
    dist.all_gather(every_p, pos.contiguous(), group=layout.group)
    vals, pos = torch.cat(every_v, -1), torch.cat(every_p, -1)
    # best first, ties to the earlier position: order by position, then a stable sort by score
    by_pos = torch.sort(torch.where(vals > float("-inf"), pos, torch.iinfo(pos.dtype).max), dim=-1,
                        stable=True).indices
    vals, pos = torch.gather(vals, -1, by_pos), torch.gather(pos, -1, by_pos)
    best = torch.sort(-vals, dim=-1, stable=True).indices[..., :k]
    return torch.gather(pos, -1, best), torch.gather(vals, -1, best)


def lse_merge(o: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials (o [B, S, H, R], lse [B, S, H]) of each rank of `group` over its keys -> the softmax over
    all of them, and its lse, on every rank. Backward is the identity (every rank holds the whole
    gradient of the merged output): each rank's partial then gets exactly its share."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_sum

    m = lse.detach().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group.group)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    # (Megatron's reduce all-reduces its input in place: hand it fresh tensors)
    den = reduce_sum(w.clone(), group=group.group)
    num = reduce_sum((o * w[..., None].to(o.dtype)).clone(), group=group.group)
    # a query none of these ranks holds a selected key for (possible below the outermost level): o = 0,
    # lse = -inf, and no NaN in either direction
    some = den > 0
    den = torch.where(some, den, torch.ones_like(den))
    return num / den[..., None].to(num.dtype), torch.where(some, m + torch.log(den), torch.full_like(den, float("-inf")))


def sharded_mla_sparse(q_nope, q_pe, c_kv, k_pe, key_pos, counted, w_uk, sel_pos, valid, scale: float,
                       levels: list) -> torch.Tensor:
    """The sparse MLA of every query over the selected keys, each rank over those it holds (`counted`
    [T_r] bool: the rows it counts; None = all), merged over `levels` (groups, innermost first): the
    attention output in latent space [B, S, H, R], the same on every rank of the groups (the caller
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
    o, lse = mla_sparse_partial(q_nope, q_pe, c_kv, k_pe, w_uk, loc.clamp(min=0), mine, scale)
    for group in levels:
        o, lse = lse_merge(o, lse, group)
    return o
