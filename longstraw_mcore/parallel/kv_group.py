"""Tensor parallelism beyond the number of KV heads: KV groups, their K/V state sharded by sequence.

With tp > Hk KV heads (Qwen3.6-27B: 4 KV heads at TP=8), r = tp / Hk consecutive TP ranks share one
KV head (a "KV group"; rank t serves KV head t // r, position g = t % r in its group), each with its
own Hq/tp query heads. Megatron splits K/V projections evenly over TP, which would cut a head in
pieces; here each rank of a group computes its head's K/V in full (`KVGroupLinear`: the head's rows
of the weight, replicated in the group), and the prompt state of that head is not replicated but
sharded by sequence inside the group (zig-zag pieces of every chunk, as context parallelism does:
parallel/cp.py): each rank keeps 1/r of the positions.

Attention (`group_attention`, one autograd node): rank g gathers the query heads of its whole group
(all heads that read its KV head), computes them against its shard of the state, merges the r
partials by log-sum-exp (all-reduce), and keeps its own heads; the keys every rank holds in full
(the branch's or the chunk's own, computed identically in the group) it computes for its own heads
only. Backward, with the merged lse and delta: the state gradient of its shard stays local (the
sinks), the group's query gradient is summed and each rank keeps its heads', and the gradient of the
replicated keys is summed over the group so every replica holds all of it. The replicated K/V
projections then get identical gradients in the group (like TP-replicated norms); their input
gradient is scaled by 1/r before Megatron's usual all-reduce over TP, so each head counts once (the
k-norm's weight gradient likewise: models/norms.py).
Exact mode's recompute seeds the chunk's (replicated) K/V with the gradient of every position,
assembled from the group's shards by an all-reduce.

With context parallelism as well, a KV head's state is sharded over its KV group x the CP ranks and
`group_cp_attention` composes the attention from autograd pieces (its docstring).

Gradient norms count a replicated projection once: it is marked `tensor_model_parallel` on the
group's first rank only, so Megatron's `param_is_not_tensor_parallel_duplicate` (and ours) skips
the copies.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longstraw_mcore.ops.attention import KeySet, kernel
from longstraw_mcore.ops.attention_merge import backward_terms, merge_partials, unpack_saved, work_dtype
from longstraw_mcore.ops.scale_grad import scale_grad
from longstraw_mcore.parallel.cp_comm import all_reduce_sum, gather_dim, merge_ranks
from longstraw_mcore.parallel.timeout import dist_timeout


@dataclass(frozen=True)
class KVGroup:
    group: object   # process group of the r TP ranks sharing one KV head
    rank: int       # g, position in the group
    size: int       # r
    head: int       # the KV head of this group (index into all Hk heads)


def new_kv_groups(tp_group, n_kv_heads: int):
    """Create the KV groups inside every TP group of the world (collective over the world: every rank
    creates every group, in the same order); return this rank's KVGroup, or None when tp <= Hk."""
    tp = tp_group.size()
    if tp <= n_kv_heads:
        return None
    r = tp // n_kv_heads
    mine = dist.get_process_group_ranks(tp_group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    own = None
    for ranks in sorted({tuple(x) for x in every}):
        for j in range(n_kv_heads):
            members = list(ranks[j * r:(j + 1) * r])
            grp = dist.new_group(ranks=members, timeout=dist_timeout())
            if dist.get_rank() in members:
                own = KVGroup(group=grp, rank=members.index(dist.get_rank()), size=r, head=j)
    return own


class KVGroupLinear(torch.nn.Module):
    """The K (or V) projection of one KV head, replicated on the r ranks of its KV group: weight
    [D, H] = rows [j*D, (j+1)*D) of the full [Hk*D, H]. Returns (out, None) like Megatron's linears."""

    def __init__(self, hidden: int, head_dim: int, n_kv: int, kv: KVGroup, tp_group, dtype, init_std: float,
                 seed: int, tag: str):
        super().__init__()
        self.kv, self.tp_group, self.n_kv, self.head_dim = kv, tp_group, n_kv, head_dim
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(tag.encode())) % (2**63))
        full = torch.empty(n_kv * head_dim, hidden, dtype=torch.float64).normal_(0.0, init_std, generator=gen)
        self.weight = torch.nn.Parameter(full[kv.head * head_dim:(kv.head + 1) * head_dim].to(dtype).contiguous())
        # counted once in gradient norms (see the module docstring)
        self.weight.tensor_model_parallel = kv.rank == 0
        self.weight.partition_dim, self.weight.partition_stride = 0, 1

    def forward(self, x):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        return F.linear(scale_grad(x, 1.0 / self.kv.size), self.weight), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp = metadata["dp_cp_group"].rank()
        key = f"{prefix}weight"
        return {key: ShardedTensor.from_rank_offsets(key, self.weight, *sharded_offsets,
                                                     (len(sharded_offsets), self.kv.head, self.n_kv),
                                                     replica_id=(0, self.kv.rank, dp))}


class _GroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cfg, *kv_t):
        q_start, scale, block, kv, sets = cfg  # sets: (start, sink, sink_scale, replicated) per key set
        kern = kernel(q)
        work = work_dtype(q.dtype)
        B, T, h, _ = q.shape
        H = h * kv.size
        shard = [j for j, s in enumerate(sets) if not s[3]]
        rep = [j for j, s in enumerate(sets) if s[3]]
        Dv = kv_t[1].shape[-1]
        parts = []
        if shard:  # the whole group's query heads against this rank's shard of the state
            qg = gather_dim(q, kv, 2)
            parts += [kern.partial_forward(qg, kv_t[2 * j], kv_t[2 * j + 1], q_start, sets[j][0], scale, block,
                                           False)[:2] for j in shard]
        # keys every rank of the group holds: its own heads only, in its slot of the group's heads
        sl = slice(kv.rank * h, (kv.rank + 1) * h)
        own_o = torch.zeros(B, H, T, Dv, dtype=work, device=q.device)
        own_lse = torch.full((B, H, T), float("-inf"), dtype=work, device=q.device)
        own_o[:, sl], own_lse[:, sl] = merge_partials(
            [kern.partial_forward(q, kv_t[2 * j], kv_t[2 * j + 1], q_start, sets[j][0], scale, block, False)[:2]
             for j in rep], (B, h, T, Dv), work, q.device)
        parts.append((own_o, own_lse))
        o, lse = merge_partials(parts, (B, H, T, Dv), work, q.device)
        if shard:  # merge the group's partials of every head
            o, lse = merge_ranks(o, lse, kv)
        out = o[:, sl].transpose(1, 2).to(q.dtype)
        lse_own = lse[:, sl].transpose(1, 2).contiguous()
        ctx.save_for_backward(q, *kv_t, out, lse_own)
        ctx.cfg = cfg
        return out, lse_own

    @staticmethod
    def backward(ctx, dout, dlse):
        q_start, scale, block, kv, sets = ctx.cfg
        n = len(sets)
        q, kv_t, out, lse, _ = unpack_saved(ctx.saved_tensors, n)
        kern = kernel(q)
        work = work_dtype(q.dtype)
        do, delta, lse_h = backward_terms(dout, dlse, out, lse, work)                        # [B,h,T,*]
        dq = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=work, device=q.device)
        grads = [None] * (2 * n)
        shard = [j for j, s in enumerate(sets) if not s[3]]
        if shard:
            qg = gather_dim(q, kv, 2)
            dog, deltag, lseg = (gather_dim(x, kv, 1) for x in (do, delta, lse_h))
            dqg = torch.zeros(qg.shape[0], qg.shape[2], qg.shape[1], qg.shape[3], dtype=work, device=q.device)
            for j in shard:
                start, sink, sink_scale, _ = sets[j]
                need = (ctx.needs_input_grad[2 + 2 * j], ctx.needs_input_grad[3 + 2 * j])
                dqj, dk, dv = kern.partial_backward(qg, kv_t[2 * j], kv_t[2 * j + 1], dog, deltag, lseg, q_start, start,
                                                    scale, block, None, True, need[0], need[1], sink=sink,
                                                    sink_scale=sink_scale)
                dqg += dqj
                if dk is not None:
                    grads[2 * j], grads[2 * j + 1] = dk.transpose(1, 2), dv.transpose(1, 2)
            h = q.shape[2]
            dq += all_reduce_sum(dqg, kv)[:, kv.rank * h:(kv.rank + 1) * h]
        for j, s in enumerate(sets):
            if not s[3]:
                continue
            dqj, dk, dv = kern.partial_backward(q, kv_t[2 * j], kv_t[2 * j + 1], do, delta, lse_h, q_start, s[0],
                                                scale, block, None, True, True, True)
            dq += dqj
            # keys replicated in the group: every replica gets the whole gradient
            grads[2 * j], grads[2 * j + 1] = all_reduce_sum(dk, kv).transpose(1, 2), all_reduce_sum(dv, kv).transpose(1, 2)
        grads = [None if g is None else g.to(kv_t[i].dtype) for i, g in enumerate(grads)]
        return (dq.transpose(1, 2).to(q.dtype) if ctx.needs_input_grad[0] else None, None, *grads)


def group_attention(q, shard_sets: list[KeySet], replicated_sets: list[KeySet], q_start: int, kv: KVGroup,
                    scale: float | None = None, block: int = 1024):
    """This rank's query heads q [B,T,h,D] over its shard of the state (`shard_sets`, this rank's
    positions of its KV head) and the keys its whole KV group holds (`replicated_sets`): (out, lse)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    sets = tuple((int(ks.start), ks.grad, float(ks.grad_scale), False) for ks in shard_sets) + \
        tuple((int(ks.start), None, 1.0, True) for ks in replicated_sets)
    kv_t = [t for ks in (*shard_sets, *replicated_sets) for t in (ks.k, ks.v)]
    return _GroupAttention.apply(q, (int(q_start), scale, int(block), kv, sets), *kv_t)


def group_cp_attention(q, local_sets: list[KeySet], shared_sets: list[KeySet], q_start: int, kv: KVGroup, layout,
                       chunk: tuple[int, int] | None, block: int = 1024):
    """KV groups together with context parallelism: a KV head's prompt state is sharded over the r
    ranks of its KV group x the n CP ranks (each keeps its KV-group share of its CP positions), so the
    attention is composed of autograd pieces (parallel/cp_comm.py) rather than one node:

      state     every query row (a chunk's: gathered over CP; a branch's: replicated there) of every
                head of the group (gathered over the KV group) against this rank's shard (`local_sets`,
                exact mode's accumulators as their sinks; present on every rank, maybe empty, so that
                every rank runs the same collectives), merged by log-sum-exp over the KV group then over
                CP (`lse_merge`: backward the identity), and this rank's heads (and rows) kept
                (`LocalHeads` / `LocalRows`: backward gathers, so every rank holds the whole gradient)
      own keys  a chunk's: this rank's rows and heads against the chunk's keys, gathered over CP
                (causal, piece by piece); a branch's (`shared_sets`, and a prefix path's): this rank's
                heads against them on every CP rank (replicated work, like the branch itself). Keys
                replicated in the KV group get their gradient summed over it (`copy_to`), as every
                replica must hold all of it (the module docstring)
      merged    the two by plain autograd (`merge_attention`)
    `chunk`: (T, s0) when q holds this CP rank's zig-zag rows of a chunk [s0, s0 + T), None for a branch.
    Returns (out [B, T_r, h, Dv], lse [B, T_r, h]) of this rank's rows and heads."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as copy_to

    from longstraw_mcore.ops.attention import attention, merge_attention
    from longstraw_mcore.parallel.cp import rank_pieces
    from longstraw_mcore.parallel.cp_comm import GatherHeads, GatherTokens, LocalHeads, LocalRows, lse_merge

    work = work_dtype(q.dtype)
    parts = []
    if chunk is not None:
        T, s0 = chunk
        rows = GatherTokens.apply(q, layout, T)
        rows_start = s0
    else:
        rows, rows_start = copy_to(q, group=layout.group), q_start
    if local_sets:
        o, lse = attention(GatherHeads.apply(rows, kv), local_sets, rows_start, block=block)
        o = o.to(work)
        for g in (kv, layout):
            o, lse = lse_merge(o, lse, g)
        o, lse = LocalHeads.apply(o, kv), LocalHeads.apply(lse[..., None], kv)[..., 0]
        if chunk is not None:
            o, lse = LocalRows.apply(o, layout, T), LocalRows.apply(lse, layout, T)
        parts.append((o, lse))
    if chunk is not None:  # this rank's rows against the chunk's keys
        (own,) = shared_sets
        k, v = (GatherTokens.apply(copy_to(x, group=kv.group), layout, T) for x in (own.k, own.v))
        os_, ls_, i = [], [], 0
        for a, b in rank_pieces(T, layout.size, layout.rank):
            o, lse = attention(q[:, i:i + b - a], [KeySet(k, v, s0)], s0 + a, block=block)
            os_.append(o.to(work))
            ls_.append(lse)
            i += b - a
        parts.append((torch.cat(os_, 1), torch.cat(ls_, 1)))
    else:
        sets = [KeySet(copy_to(ks.k, group=kv.group), copy_to(ks.v, group=kv.group), ks.start) for ks in shared_sets]
        o, lse = attention(q, sets, q_start, block=block)
        parts.append((o.to(work), lse))
    out, lse = merge_attention(parts, with_lse=True)
    return out.to(q.dtype), lse
