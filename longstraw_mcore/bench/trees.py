"""Synthetic prefix-tree groups for benchmarks and tests: the responses of a full tree."""

from __future__ import annotations

import torch


def full_tree(vocab: int, widths, lengths, gen: torch.Generator) -> list[list[int]]:
    """Responses of a full tree: `widths[d]` children per node at depth d, segments of `lengths[d]`
    tokens (the last: the responses' own tails); siblings begin with different tokens, so the tree
    has exactly that shape. (1, 2, 2, 4) x (24, 24, 6, 10): 16 responses of 64 tokens sharing a
    24-token segment, then two of 24, four of 6: 256 of 1,024 tokens to replay (75% shared)."""
    if len(widths) != len(lengths) or min(list(widths) + list(lengths)) < 1 or max(widths) > vocab:
        raise ValueError(f"widths {list(widths)}, lengths {list(lengths)}: as many of each, all >= 1, widths <= "
                         f"the vocabulary ({vocab})")
    out: list[list[int]] = []

    def grow(prefix, d):
        if d == len(widths):
            out.append(prefix)
            return
        for f in torch.randperm(vocab, generator=gen)[:widths[d]].tolist():
            grow(prefix + [f] + torch.randint(0, vocab, (lengths[d] - 1,), generator=gen).tolist(), d + 1)

    grow([], 0)
    return out
