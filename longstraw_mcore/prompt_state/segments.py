"""The states the shared response segments of a prefix tree leave (replay/tree.py), along the live path.

A segment is replayed once, with autograd, against the prompt state and the segments above it; its
layers' contributions are recorded as it runs (`SegmentContext`): attention's own K/V, Gated
DeltaNet's state after it, MLA's own latents (with their index keys and positions). Once it has run,
each recorded tensor gets an autograd leaf (>= float32, like the state gradients), and the segment's
children read the leaves: attention key sets at the segment's positions, the deepest segment's GDN
state, the latents concatenated before the child's own. Every child's backward adds into the leaves'
gradients; the segment's own backward (`backward_roots`) then runs once through its graph, seeded
with them and with the gradient its log-probs received from the loss terms of the responses through
it. Only the live path is on the stack (depth first), so what is alive beyond a flat replay is the
path's segment graphs and leaves.

Segments are replicated like a replayed branch: under context parallelism every rank replays them
whole (their K/V join the branch's own keys as the sets counted once; their latents the own rows);
under tensor parallelism each rank records its heads, as for the prompt state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw_mcore.ops.attention import KeySet
from longstraw_mcore.prompt_state.base import grad_dtype
from longstraw_mcore.prompt_state.hooks import GDNState, MLAKeys


def _leaf(t: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
    if t is None:
        return None
    # the same storage where the dtype already is >= float32: the segment's graph holds it anyway, and
    # both are dropped together when the segment is popped
    x = t.detach().to(grad_dtype(t.dtype)) if grad and t.is_floating_point() else t.detach()
    return x.requires_grad_(True) if grad and t.is_floating_point() else x


@dataclass
class Segment:
    start: int                                   # absolute position of its first token
    length: int                                  # its tokens
    produced: dict = field(default_factory=dict)  # layer -> what it recorded (graph): (k, v) | GDNState | MLAKeys
    leaves: dict = field(default_factory=dict)    # layer -> the same as autograd leaves (children read these)
    logp: torch.Tensor | None = None             # [S] its tokens' log-probs (graph)
    logp_leaf: torch.Tensor | None = None
    # pipeline stages (replay/pipeline.py): this stage's received input and its output (graph)
    stage_input: torch.Tensor | None = None
    stage_output: torch.Tensor | None = None

    def set_logprobs(self, logp: torch.Tensor | None, grad: bool) -> None:
        """The segment's tokens' log-probs (the last pipeline stage's), and their leaf."""
        self.logp, self.logp_leaf = logp, _leaf(logp, grad)

    def seal(self, logp: torch.Tensor | None, grad: bool) -> None:
        """After the segment's forward: the leaves its children read."""
        self.set_logprobs(logp, grad)
        for n, rec in self.produced.items():
            if isinstance(rec, GDNState):
                self.leaves[n] = GDNState(conv=_leaf(rec.conv, grad), recurrent=_leaf(rec.recurrent, grad))
            elif isinstance(rec, MLAKeys):
                self.leaves[n] = MLAKeys(_leaf(rec.c, grad), _leaf(rec.pe, grad), _leaf(rec.ik, False), rec.pos,
                                         ig=_leaf(rec.ig, False))
            else:
                self.leaves[n] = tuple(_leaf(t, grad) for t in rec)

    def backward_roots(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors with graph, their gradients) for the segment's backward: every recorded tensor
        whose leaf received a gradient, and the log-probs."""
        roots, grads = [], []

        def add(t, leaf):
            if t is not None and t.requires_grad and leaf is not None and leaf.grad is not None:
                roots.append(t)
                grads.append(leaf.grad.to(t.dtype))

        add(self.logp, self.logp_leaf)
        for n, rec in self.produced.items():
            leaf = self.leaves[n]
            if isinstance(rec, GDNState):
                add(rec.conv, leaf.conv)
                add(rec.recurrent, leaf.recurrent)
            elif isinstance(rec, MLAKeys):
                add(rec.c, leaf.c)
                add(rec.pe, leaf.pe)
            else:
                for t, lf in zip(rec, leaf):
                    add(t, lf)
        return roots, grads


class SegmentPath:
    """The segments on the live path, outermost first."""

    def __init__(self):
        self.stack: list[Segment] = []

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.stack)

    def logprobs(self) -> list[torch.Tensor]:
        return [s.logp_leaf for s in self.stack]

    # --- what a call below the path reads, per layer -------------------------------------------------
    def key_sets(self, n: int, dtype) -> list[KeySet]:
        return [KeySet(s.leaves[n][0].to(dtype), s.leaves[n][1].to(dtype), s.start) for s in self.stack
                if n in s.leaves]

    def gdn(self, n: int) -> GDNState | None:
        for s in reversed(self.stack):
            if n in s.leaves:
                return s.leaves[n]
        return None

    def latents(self, n: int, own: MLAKeys) -> MLAKeys:
        """The path's latents of layer `n` and then `own`'s (expanded to its batch)."""
        recs = [s.leaves[n] for s in self.stack if n in s.leaves]
        if not recs:
            return own
        B = own.c.shape[0]

        def cat(xs, last):
            return torch.cat([x.to(last.dtype).expand(B, *x.shape[1:]) for x in xs] + [last], 1)

        ik = None if own.ik is None else cat([r.ik for r in recs], own.ik)
        ig = None if own.ig is None else cat([r.ig for r in recs], own.ig)  # a pooled indexer's gate scores
        return MLAKeys(cat([r.c for r in recs], own.c), cat([r.pe for r in recs], own.pe), ik,
                       torch.cat([r.pos for r in recs] + [own.pos]), ig=ig, pooling=own.pooling)
