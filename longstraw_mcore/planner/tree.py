"""A prefix-tree workload for the planner (`longstraw plan --tree WIDTHS:LENGTHS`): a full tree whose
node at depth d has widths[d] children, each a segment of lengths[d] tokens (the last depth: the
responses' own tails), as replay/tree.py replays it."""

from __future__ import annotations

from longstraw_mcore.config import ConfigError


def parse_tree(spec: str) -> tuple[list[int], list[int]]:
    try:
        widths, lengths = ([int(x) for x in part.split(",")] for part in spec.split(":"))
    except ValueError:
        widths = lengths = []
    if not widths or len(widths) != len(lengths) or min(widths + lengths) < 1:
        raise ConfigError(f"--tree {spec!r}: must be WIDTHS:LENGTHS, as many positive integers of each (e.g. "
                          "1,2,2,4:24,24,6,10: 16 responses of 64 tokens, a 24-token segment shared by all, ...)")
    return widths, lengths


def responses_and_length(widths, lengths) -> tuple[int, int]:
    """(G, R): the tree's responses and their length."""
    G = 1
    for w in widths:
        G *= w
    return G, sum(lengths)


def tree_pieces(widths, lengths) -> list:
    """(tokens, the segment lengths above it, is a segment) of every piece the tree replays
    (planner/flops.py `pieces`), as replay/tree.py lists them."""
    out, nodes = [], 1
    for d, (w, n) in enumerate(zip(widths, lengths)):
        nodes *= w
        out += [(n, tuple(lengths[:d]), d < len(lengths) - 1)] * nodes
    return out


def tree_passes(widths, lengths, budget: int) -> int:
    """The replay micro-steps of the tree (the time model's passes): one per segment, and each node's
    widths[-1] tails of lengths[-1] tokens in micro-steps under the token budget, as replay/tree.py
    `tree_steps` cuts them (replay/plan.py `micro_steps`)."""
    from longstraw_mcore.replay.plan import micro_steps

    parents = 1
    for w in widths[:-1]:
        parents *= w
    segments = sum(1 for n, _, seg in tree_pieces(widths, lengths) if seg)
    return segments + parents * len(micro_steps([lengths[-1]] * widths[-1], budget))


def path_state_bytes(family, cfg, lengths, layer_types) -> int:
    """What the live path's segments add to a branch's replay on one rank: their state (as the prompt
    state's per-position and per-layer terms, for the stage's `layer_types`; replicated over CP), as
    autograd leaves (float32 copies below float32) and their gradients; the recorded tensors
    themselves are in the segments' graphs, counted as the branch's saved tensors."""
    from longstraw_mcore.prompt_state.base import element_size, grad_dtype
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes

    m = cfg.model
    state = sum(sum(analytic_state_bytes(family.layers, m, cfg.parallel.tp, n, layer_types=layer_types).values())
                for n in lengths[:-1])
    wide = element_size(grad_dtype(m.torch_dtype)) / element_size(m.torch_dtype)
    copies = wide if grad_dtype(m.torch_dtype) != m.torch_dtype else 0.0
    return int(state * (wide + copies))
