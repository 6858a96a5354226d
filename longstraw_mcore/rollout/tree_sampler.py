"""Tree sampling (`rollout.branch_at`, `rollout.branch_k`): responses that share their first tokens,
sampled against the captured prompt state and the states of the shared segments, never recomputing a
shared prefix.

`group_size` trunks start from the prompt, as rollout/sampler.py samples them; when the responses
reach a depth in `branch_at`, each one still running becomes a shared segment: its tokens since the
last split run once, without autograd, recording their K/V, GDN state and MLA latents
(prompt_state/segments.py, as replay/tree.py's segments), and it continues as `branch_k` children
that read those states. Between splits a branch replays only its own tokens since the last split (the
flat sampler's O(R^2), now per segment), batched with its siblings. A branch that stops before a
split stays one response. Up to group_size x branch_k ** len(branch_at) responses, ordered as the
leaves of the tree.

Random numbers: every step draws one uniform number per possible leaf from the generator keyed by
(seed, prompt index); a branch uses the number of its first leaf, so every layout picks the same
tokens from the same logits (as the flat sampler), and a split's children differ from the first
token after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Branch:
    leaf: int                       # its first leaf's number: which random number it uses
    span: int                       # the leaves below it
    tokens: list[int]               # the whole response so far
    logprobs: list[float]
    start: int = 0                  # depth of its last split (0: the prompt)
    path: list = field(default_factory=list)   # the shared segments above it (prompt_state/segments.Segment)

    def inputs(self, prompt_last: int) -> list[int]:
        """What it runs since its last split: the token before it (prompt[-1] at the prompt), its own."""
        return [self.tokens[self.start - 1] if self.start else prompt_last] + self.tokens[self.start:]


def _segment(model, core, state, layout, b: _Branch, prompt_last: int, device):
    """Branch `b`'s tokens since its last split as a shared segment below its path (no autograd)."""
    ids = b.inputs(prompt_last)[:-1]
    return b.path + [record_segment(model, core, state, layout, b.path, b.start, ids, device)]


def record_segment(model, core, state, layout, path: list, start: int, inputs: list[int], device):
    """A shared segment below `path` (a list of segments) at response depth `start`: `inputs` (the token
    before it, then its own tokens but the last) run once without autograd, recording their K/V, GDN
    state and MLA latents (prompt_state/segments.py) for the branches that continue after it."""
    from longstraw_mcore.prompt_state.contexts import SegmentContext
    from longstraw_mcore.prompt_state.segments import Segment, SegmentPath

    ids = torch.tensor([inputs], device=device)
    seg = Segment(start=state.length + start, length=len(inputs))
    stack = SegmentPath()
    stack.stack = list(path)
    ctx = SegmentContext(state, stack, seg, layout)
    if core.pg_collection.pp.size() == 1:
        core.forward_hidden(ids, ctx)
    else:
        from longstraw_mcore.replay.pipeline import forward_once

        forward_once(model, lambda c: c.forward_hidden(ids, ctx), lambda c, h: None)
    seg.seal(None, grad=False)
    return seg


@torch.no_grad()
def sample_tree(model, prompt: list[int], state, cfg, gen: torch.Generator, layout, next_tokens):
    """(responses, log-probs) of a sampled tree; `next_tokens(ids, ctx, u)` is the flat sampler's step."""
    from longstraw_mcore.prompt_state.contexts import ReplayContext
    from longstraw_mcore.prompt_state.segments import SegmentPath
    from longstraw_mcore.replay.steps import core_of

    core = core_of(model)
    device = next(core.parameters()).device
    span = cfg.branch_k ** len(cfg.branch_at)
    leaves = cfg.group_size * span
    live = [_Branch(g * span, span, [], []) for g in range(cfg.group_size)]
    done: list[_Branch] = []
    splits, stop = set(cfg.branch_at), set(cfg.stop_ids)
    for t in range(cfg.max_tokens):
        if t in splits:
            grown = []
            for b in live:
                path = _segment(model, core, state, layout, b, prompt[-1], device)
                step = b.span // cfg.branch_k
                grown += [_Branch(b.leaf + c * step, step, list(b.tokens), list(b.logprobs), t, path)
                          for c in range(cfg.branch_k)]
            live = grown
        u = torch.rand(leaves, generator=gen, dtype=torch.float64)  # drawn every step, whatever stopped
        by_path: dict[int, list[_Branch]] = {}
        for b in live:
            by_path.setdefault(id(b.path), []).append(b)
        still = []
        for group in by_path.values():
            # siblings: the same path and split depth, so the same first input and length
            ids = torch.tensor([b.inputs(prompt[-1]) for b in group], device=device)
            path = SegmentPath()
            path.stack = list(group[0].path)
            ctx = ReplayContext(state, batch=len(group), store_probs=False, layout=layout, path=path)
            nxt, lp = next_tokens(ids, ctx, u[[b.leaf for b in group]])
            for i, b in enumerate(group):
                tok = int(nxt[i])
                b.tokens.append(tok)
                b.logprobs.append(float(lp[i]))
                (done if tok in stop else still).append(b)
        live = still
        if not live:
            break
    out = sorted(done + live, key=lambda b: b.leaf)
    return [b.tokens for b in out], [b.logprobs for b in out]
