"""Context parallelism: which prompt positions a CP rank owns, as pure index math.

A capture chunk [s0, s0 + T) is cut into 2n near-equal contiguous pieces (n = CP size; the first
T mod 2n pieces one token longer) and rank r owns pieces r and 2n-1-r (zig-zag): under a causal mask
the work of a chunk's own keys is then balanced (rank r's early piece sees little, its late piece
much). Over a prompt, rank r therefore owns 1/n of every chunk and, in its state buffer, the K/V of
its positions in chunk order. Ranks never need each other's positions in any particular place: a
chunk's queries meet the earlier chunks' keys wherever those are stored (no causal mask is needed
between chunks).

    rank 0 of 2, T = 10:   pieces [0,3) [3,6) [6,8) [8,10)   ->   rank 0: [0,3) + [8,10),  rank 1: [3,6) + [6,8)

`CPLayout` is what a context needs of the CP group: the group, this rank, the size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPLayout:
    group: object        # torch.distributed ProcessGroup of the context-parallel ranks
    rank: int
    size: int

    @classmethod
    def of(cls, group) -> "CPLayout | None":
        """The layout of `group`, or None when it has one rank (no context parallelism)."""
        if group is None or group.size() == 1:
            return None
        return cls(group=group, rank=group.rank(), size=group.size())


def piece_bounds(T: int, n: int) -> list[tuple[int, int]]:
    """n contiguous near-equal pieces of [0, T); the first T mod n are one longer (some may be empty)."""
    base, extra = divmod(T, n)
    out, s = [], 0
    for i in range(n):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return out


def rank_pieces(T: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The (start, end) ranges of [0, T) that `rank` owns (zig-zag: pieces rank and 2cp-1-rank)."""
    if cp == 1:
        return [(0, T)]
    pieces = piece_bounds(T, 2 * cp)
    return [pieces[rank], pieces[2 * cp - 1 - rank]]


def local_positions(T: int, cp: int, rank: int) -> list[int]:
    return [i for s, e in rank_pieces(T, cp, rank) for i in range(s, e)]


def local_count(T: int, cp: int, rank: int) -> int:
    return sum(e - s for s, e in rank_pieces(T, cp, rank))


def gather_order(T: int, cp: int) -> torch.Tensor:
    """Positions of the tokens in rank order (rank 0's local tokens, then rank 1's, ...): the inverse of
    this permutation puts gathered tokens back in sequence order."""
    return torch.tensor([i for r in range(cp) for i in local_positions(T, cp, r)], dtype=torch.long)


def gdn_by_heads(n_k_heads: int, cp: int, choice: str = "auto") -> bool:
    """Whether a Gated DeltaNet layer with `n_k_heads` key heads on this TP rank runs context parallel
    by head shards (parallel/cp_comm.py: each rank the whole chunk for 1/cp of the heads) rather than
    by sequence pieces (parallel/cp_gdn.py: any head count); `choice` is model.gdn_cp."""
    return choice != "sequence" and n_k_heads % cp == 0


def gdn_path(m, tp: int, cp: int) -> str | None:
    """Which way a model's Gated DeltaNet layers run at this layout: "heads" or "sequence" under
    context parallelism (`gdn_by_heads` with model.gdn_cp), "whole" without it, None for a model
    without them (the planner's and `plan`'s one answer)."""
    if not hasattr(m, "linear_num_key_heads"):
        return None
    if cp == 1:
        return "whole"
    return "heads" if gdn_by_heads(m.linear_num_key_heads // tp, cp, m.gdn_cp) else "sequence"
