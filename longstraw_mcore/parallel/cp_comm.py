"""The collectives of context parallelism, plain torch.distributed (gloo on CPU, NCCL on CUDA).

Tensors are [B, T, H, ...] (batch, tokens, heads; package legend). A rank holds its zig-zag pieces of a chunk of T
tokens (parallel/cp.py); ranks' piece counts differ by at most one per piece, so gathers pad to the
largest and trim.

    gather_tokens(x_local)            -> x [B, T, ...] in sequence order, on every rank
    local_rows(x)                     -> this rank's rows of a full-chunk tensor
    SeqToHeads(x_local)   (autograd)  -> the whole chunk, this rank's 1/n of the heads
    HeadsToSeq(x_heads)   (autograd)  -> this rank's tokens, all heads
    merge_ranks(O_r, lse_r)           -> the softmax over every rank's keys, on every rank (no autograd)
The autograd pieces a composed sharded attention is built of (parallel/cp_dsa.py, parallel/kv_group.py):
    GatherTokens / LocalRows          this rank's rows <-> the whole chunk (each other's backward)
    GatherHeads / LocalHeads          this rank's heads <-> every head of a group (each other's backward)
    lse_merge(o_r, lse_r)             the softmax over every rank's keys; backward the identity (every
                                      rank then holds the whole gradient of the merged output)
SeqToHeads and HeadsToSeq are each other's backward: a gradient with respect to a head shard of the
whole chunk goes back to the tokens' owners for every head, and vice versa. Each is one all-to-all
(`seq_to_heads`, `heads_to_seq`): rank r sends rank j only what j keeps (its tokens of j's heads, or
j's tokens of its heads), so a rank receives (n-1)/n of its own share, where an all-gather of the
tokens (every head) and a cut to its heads received n-1 shares and dropped most of them: 1/n of the
bytes (tools/bench_cp.py counts both directions). Ranks' token counts may differ: the split sizes
say so (no padding).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from longstraw_mcore.parallel.cp import CPLayout, gather_order, local_count, local_positions


def _index(T: int, layout: CPLayout, device) -> torch.Tensor:
    return torch.tensor(local_positions(T, layout.size, layout.rank), dtype=torch.long, device=device)


def local_rows(x: torch.Tensor, layout: CPLayout, T: int) -> torch.Tensor:
    """[B, T, ...] -> this rank's [B, S_r, ...] (its zig-zag pieces, in order)."""
    return x.index_select(1, _index(T, layout, x.device))


def gather_tokens(x: torch.Tensor, layout: CPLayout, T: int) -> torch.Tensor:
    """Every rank's [B, S_r, ...] -> [B, T, ...] in sequence order (no autograd)."""
    sizes = [local_count(T, layout.size, r) for r in range(layout.size)]
    m = max(sizes)
    padded = x.new_zeros((x.shape[0], m) + tuple(x.shape[2:]))
    padded[:, :x.shape[1]] = x
    parts = [torch.empty_like(padded) for _ in range(layout.size)]
    dist.all_gather(parts, padded.contiguous(), group=layout.group)
    ranked = torch.cat([p[:, :n] for p, n in zip(parts, sizes)], 1)        # rank order
    out = torch.empty_like(ranked)
    out[:, gather_order(T, layout.size).to(x.device)] = ranked
    return out


def all_reduce_sum(x: torch.Tensor, layout) -> torch.Tensor:
    """In-place sum over `layout.group` (a CPLayout or a KV group); returns x (made contiguous)."""
    x = x.contiguous()
    dist.all_reduce(x, group=layout.group)
    return x


def gather_dim(x: torch.Tensor, layout, dim: int = 2) -> torch.Tensor:
    """Every rank's equal-shaped x, concatenated along `dim` in rank order (`layout`: anything with a
    `.group` and `.size`: a CPLayout, a KV group)."""
    parts = [torch.empty_like(x) for _ in range(layout.size)]
    dist.all_gather(parts, x.contiguous(), group=layout.group)
    return torch.cat(parts, dim)


def own_heads(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    h = x.shape[2] // layout.size
    return x[:, :, layout.rank * h:(layout.rank + 1) * h]


def _exchange(parts: list[torch.Tensor], recv_shapes: list[tuple], layout: CPLayout) -> list[torch.Tensor]:
    """One all-to-all: parts[j] goes to rank j; returns what each rank i sent here, shaped recv_shapes[i]."""
    send = torch.cat([p.reshape(-1) for p in parts])
    sizes = [math.prod(s) for s in recv_shapes]
    recv = send.new_empty(sum(sizes))
    dist.all_to_all_single(recv, send, sizes, [p.numel() for p in parts], group=layout.group)
    return [c.view(s) for c, s in zip(recv.split(sizes), recv_shapes)]


def seq_to_heads(x: torch.Tensor, layout: CPLayout, T: int) -> torch.Tensor:
    """[B, S_r, H, ...] this rank's tokens -> [B, T, H/n, ...] the chunk in sequence order, this rank's
    heads (one all-to-all)."""
    n, h = layout.size, x.shape[2] // layout.size
    parts = [x[:, :, j * h:(j + 1) * h] for j in range(n)]
    rest = (x.shape[0],), (h, *x.shape[3:])
    got = _exchange(parts, [(*rest[0], local_count(T, n, i), *rest[1]) for i in range(n)], layout)
    ranked = torch.cat(got, 1)                                              # rank order
    out = torch.empty_like(ranked)
    out[:, gather_order(T, n).to(x.device)] = ranked
    return out


def heads_to_seq(x: torch.Tensor, layout: CPLayout, T: int) -> torch.Tensor:
    """[B, T, H/n, ...] the chunk, this rank's heads -> [B, S_r, H, ...] this rank's tokens, all heads
    (one all-to-all)."""
    n = layout.size
    parts = [x.index_select(1, torch.tensor(local_positions(T, n, j), dtype=torch.long, device=x.device))
             for j in range(n)]
    S_r = local_count(T, n, layout.rank)
    got = _exchange(parts, [(x.shape[0], S_r, *x.shape[2:])] * n, layout)
    return torch.cat(got, 2)


class SeqToHeads(torch.autograd.Function):
    """[B, S_r, H, ...] local tokens -> [B, T, H/n, ...]: the whole chunk, this rank's heads."""

    @staticmethod
    def forward(ctx, x, layout: CPLayout, T: int):
        assert x.shape[2] % layout.size == 0, (x.shape, layout.size)
        ctx.layout, ctx.T = layout, T
        return seq_to_heads(x, layout, T)

    @staticmethod
    def backward(ctx, g):
        return heads_to_seq(g, ctx.layout, ctx.T), None, None


class HeadsToSeq(torch.autograd.Function):
    """[B, T, H/n, ...] the whole chunk, this rank's heads -> [B, S_r, H, ...] local tokens, all heads."""

    @staticmethod
    def forward(ctx, x, layout: CPLayout, T: int):
        ctx.layout, ctx.T = layout, T
        return heads_to_seq(x, layout, T)

    @staticmethod
    def backward(ctx, g):
        return seq_to_heads(g, ctx.layout, ctx.T), None, None


def merge_ranks(o, lse, layout):
    """The softmax over every rank's keys from each rank's (O_r, lse_r), on every rank of `layout.group`
    (a CPLayout, or a KV group)."""
    m = lse.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=layout.group)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)
    den = all_reduce_sum(w.clone(), layout)
    num = all_reduce_sum(o * w[..., None], layout)
    empty = den == 0
    one = torch.ones_like(den)
    out = num / torch.where(empty, one, den)[..., None]
    return out, torch.where(empty, torch.full_like(den, float("-inf")), m + torch.log(torch.where(empty, one, den)))


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
        return own_heads(all_reduce_sum(g.clone(), ctx.grp), ctx.grp).contiguous(), None


class LocalHeads(torch.autograd.Function):
    """[B, S, H, ...] every head (the same on every rank of the group) -> this rank's [B, S, H/n, ...]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.grp = group
        return own_heads(x, group).contiguous()

    @staticmethod
    def backward(ctx, g):
        return gather_dim(g.contiguous(), ctx.grp, 2), None


def lse_merge(o: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials (o [B, T, H, R], lse [B, T, H]) of each rank of `group` over its keys -> the softmax over
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
