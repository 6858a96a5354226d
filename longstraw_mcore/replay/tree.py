"""A group's responses as a prefix tree (a radix trie), and its replay steps in depth-first order.

Responses that begin with the same tokens share them: a shared run of tokens is a *segment*, replayed
once with autograd; its children (further segments, or the responses' own tails) replay against the
prompt state and the states the segments on their path left (prompt_state/segments.py). Responses

    r0 = a b c d e      r1 = a b c f      r2 = a b g      r3 = h i

give the tree  root -> [a b] -> {[c] -> {tail d e (r0), tail f (r1)}, tail g (r2)},  tail h i (r3),
and the steps (depth-first: only the live path's segment states are alive)

    segment [0, 2) (r0 r1 r2)    a b replayed once; its K/V / GDN state / latents are kept with graph
    segment [2, 3) (r0 r1)       c against the prompt and [a b]
    replay r0 from depth 3       d e
    replay r1 from depth 3       f
    segment_backward [2, 3)      c's backward, seeded with what r0 and r1 sent into its state and log-probs
    replay r2 from depth 2       g
    segment_backward [0, 2)
    replay r3 from depth 0       h i: no shared prefix, a plain replay

A segment [a, b) of responses y runs the inputs y[a-1] .. y[b-2] (prompt[-1] for y[-1]) at positions
P-1+a .. P-2+b and scores the targets y[a:b]; a child starting at depth b runs y[b-1] .. at P-1+b.
Every response still gets its whole log-prob vector and one loss term over it: the segments'
log-probs enter it as leaves, whose gradients the segment's backward takes on (the chain rule, so
any per-response objective is exact). The replay runs each segment's tokens once
(replay/engine.py `steps_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longstraw_mcore.replay.plan import Step, replay_steps


@dataclass
class Node:
    depth: tuple[int, int]                  # response tokens [a, b) this node covers (root: (0, 0))
    members: list[int]                      # the responses passing through it (they share tokens [0, b))
    ends: list[int] = field(default_factory=list)     # responses that end exactly at depth b
    children: list["Node"] = field(default_factory=list)
    tails: list[int] = field(default_factory=list)    # responses continuing alone below it


def _common(responses: list[list[int]], members: list[int], start: int) -> int:
    """How far (from `start`) the members agree."""
    end = start
    while True:
        if any(len(responses[b]) <= end for b in members):
            return end
        tok = responses[members[0]][end]
        if any(responses[b][end] != tok for b in members):
            return end
        end += 1


def _grow(node: Node, responses: list[list[int]]) -> None:
    d = node.depth[1]
    node.ends = [b for b in node.members if len(responses[b]) == d]
    groups: dict[int, list[int]] = {}
    for b in node.members:
        if len(responses[b]) > d:
            groups.setdefault(responses[b][d], []).append(b)
    for members in groups.values():
        if len(members) == 1:
            node.tails.append(members[0])
            continue
        child = Node((d, _common(responses, members, d)), members)
        _grow(child, responses)
        node.children.append(child)


def build_tree(responses: list[list[int]]) -> Node:
    """The radix trie of `responses` (the root covers no token)."""
    for b, r in enumerate(responses):
        if not r:
            raise ValueError(f"response {b} is empty: a branch needs at least one token")
    root = Node((0, 0), list(range(len(responses))))
    _grow(root, responses)
    return root


def shares(root: Node) -> bool:
    """Whether any two responses share a token (otherwise the tree is the flat group)."""
    return bool(root.children)


def tree_pieces(root: Node, responses: list[list[int]], path: tuple[int, ...] = ()) -> list:
    """(tokens, the segment lengths above it, is a segment) of every piece the tree replays: its
    segments and the responses' tails (what the FLOP model counts: planner/flops.py `pieces`), a node's
    tails together and in `tree_steps`' order (the FLOP model cuts them into the same micro-steps)."""
    d = root.depth[1]
    out = [(len(responses[b]) - d, path, False) for b in sorted(root.tails)]
    for c in root.children:
        n = c.depth[1] - c.depth[0]
        out += [(n, path, True)] + tree_pieces(c, responses, path + (n,))
    return out


def tree_steps(root: Node, lengths: list[int], budget: int) -> list[Step]:
    """The depth-first replay steps of the tree: `segment` (index: the step's node number, span: its
    depth range, branches: its members), `replay` (span: (depth the tails start at, 0), branches: the
    tails, grouped into micro-steps under the token budget `budget` by the tokens each replays below
    that depth, `lengths[b]` - depth: replay/plan.py `micro_steps`), `segment_backward` (the node's
    number and span, branches: the responses ending at it, whose loss terms are complete there)."""
    steps: list[Step] = []
    counter = [0]

    def visit(node: Node, number: int) -> None:
        d = node.depth[1]
        for child in node.children:
            counter[0] += 1
            n = counter[0]
            steps.append(Step("segment", n, child.depth, tuple(child.members)))
            visit(child, n)
            steps.append(Step("segment_backward", n, child.depth, tuple(child.ends)))
        steps.extend(replay_steps(sorted(node.tails), lengths, budget, first=len(steps), depth=d))

    visit(root, 0)
    return steps
