"""Sequence-parallel Gated DeltaNet under context parallelism: for any number of CP ranks, whatever the
head count (prompt_state/contexts.py takes it where the key heads do not split over CP; the head-
sharded exchange of parallel/cp_comm.py where they do).

A capture or recompute chunk of T tokens is cut into 2n zig-zag pieces (parallel/cp.py); rank r holds
pieces r and 2n-1-r. Each piece p runs on its own rank from an unknown entering recurrent state
(ops/gdn_pieces.py): its outputs are o0 + S_p^T c and it leaves M_p S_p + B_p. So:

  1. conv halo: each rank all-gathers every piece's last W-1 pre-conv tokens (2n x (W-1) x Ch
     values); piece p's conv window is the last W-1 tokens before it: the chunk's entering window
     followed by the tails of pieces 0..p-1 (pieces shorter than W-1 contribute what they have);
  2. piece maps: the mixer's core runs each own piece from its window, one rule pass on values K
     wider (ops/gdn_pieces.piece_maps);
  3. scan: [M_p | B_p] of every piece are all-gathered (2n x Hv x Dk x (Dk + Dv) values) and every
     rank runs S_{p+1} = M_p S_p + B_p from the chunk's entering state, so every rank holds the state
     leaving the chunk and the one entering each of its pieces;
  4. outputs: o = o0 + S_p^T c for its own pieces, in its token order (no exchange back).
The state is whole (every local head) on every CP rank. Collective bytes per layer and chunk do not
grow with T; the compute per rank is 1/n of the tokens at about twice the width (K + V values).

Gradients (exact mode's recompute): the gathers are autograd functions whose backward sums the
gathered gradient over the ranks (every rank's scan uses every piece), so each piece's maps get the
gradient of every rank's use, and the piece outputs are this rank's tokens as elsewhere under CP. The
state entering the chunk and the one leaving it are replicated: prompt_state/gdn.py sums the former's
gradient over CP and seeds the latter's at 1/n per rank (contexts.py: the CP seed scaling).
tests/dist/test_cp_sequence_gdn.py holds capture, both modes and the gradients to one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longstraw_mcore.parallel.cp import CPLayout, piece_bounds


class _Gather(torch.autograd.Function):
    """Every CP rank's equal-shaped x stacked [n, ...] in rank order; backward: this rank's slot of
    the gradient summed over the ranks (each rank's use of the whole stack adds to it)."""

    @staticmethod
    def forward(ctx, x, layout: CPLayout):
        ctx.layout = layout
        parts = [torch.empty_like(x) for _ in range(layout.size)]
        dist.all_gather(parts, x.contiguous(), group=layout.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.layout.group)
        return g[ctx.layout.rank], None


def _gather(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """`_Gather`, taking part in the backward on every rank whenever autograd records: a rank whose
    pieces are empty (a chunk shorter than 2n) makes maps that depend on nothing trainable, and without
    a node of its own it would skip the backward's all-reduce that its peers run."""
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_(True)
    return _Gather.apply(x, layout)


def _where(p: int, n: int) -> tuple[int, int]:
    """(rank, slot) holding piece p of 2n (zig-zag: rank r holds pieces r and 2n-1-r, in that order)."""
    return (p, 0) if p < n else (2 * n - 1 - p, 1)


def sequence_recurrent(core, inputs: tuple, state, layout: CPLayout, T: int, n_k_heads: int,
                       conv_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixer's core over a chunk of T tokens held as zig-zag pieces (module docstring): this rank's
    outputs [B, S_r, Hv, Dv] (state dtype) and the whole state leaving the chunk (conv window, recurrent
    state). `inputs` are the core's (q, k, v, b, a) for this rank's tokens, pre-conv; `state` the whole
    state entering it (its `.conv`, `.recurrent`; None at the start)."""
    n, r, W1 = layout.size, layout.rank, conv_width - 1
    assert W1 >= 1, conv_width
    q, k, v = inputs[:3]
    lens = [e - s for s, e in piece_bounds(T, 2 * n)]
    mine = (r, 2 * n - 1 - r)
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)      # [B, S_r, Ch]: the conv's channels
    Bsz, Ch = mixed.shape[0], mixed.shape[-1]
    tails, off = [], 0
    for p in mine:
        t = mixed[:, off + max(0, lens[p] - W1):off + lens[p]]
        tails.append(F.pad(t, (0, 0, W1 - t.shape[1], 0)))                  # left-padded to W-1 tokens
        off += lens[p]
    every = _gather(torch.stack(tails), layout)                      # [n, 2, B, W-1, Ch]

    def tail(p):
        rank, slot = _where(p, n)
        return every[rank, slot][:, W1 - min(lens[p], W1):]

    start = state.conv.transpose(1, 2) if state is not None else mixed.new_zeros(Bsz, W1, Ch)

    def window(upto):  # the last W-1 tokens before piece `upto`, as a conv window [B, Ch, W-1]
        return torch.cat([start] + [tail(i) for i in range(upto)], 1)[:, -W1:].transpose(1, 2).contiguous()

    maps, off = {}, 0
    for p in mine:
        piece = tuple(x[:, off:off + lens[p]] for x in inputs)
        maps[p], _ = core(*piece, heads=(0, n_k_heads), state=None, window=window(p))
        off += lens[p]
    own = torch.stack([torch.cat([maps[p].M, maps[p].B], -1) for p in mine])   # [2, B, Hv, Dk, Dk + Dv]
    gathered = _gather(own, layout)
    K = maps[mine[0]].M.shape[-1]
    S = (state.recurrent if state is not None
         else own.new_zeros(*own.shape[1:-1], own.shape[-1] - K))
    entering = {}
    for p in range(2 * n):
        entering[p] = S
        mb = gathered[_where(p, n)]
        S = mb[..., :K] @ S.to(mb.dtype) + mb[..., K:]
    out = torch.cat([maps[p].output(entering[p]) for p in mine], 1)
    return out, window(2 * n), S
