"""The three ways a model run meets the prompt state (passed as the mixers' `inference_context`).

- `CaptureContext`: a no-grad prompt chunk at `offset`; attention K/V of the chunk are appended
  into the preallocated buffers, GDN state replaced (exact mode first records the state entering the
  chunk: the recompute of that chunk needs it).
- `ReplayContext`: a branch after the whole prompt; reads the state, writes nothing (the branch's
  own K/V and recurrent updates are local tensors of its graph: its scratch, freed with it). In
  exact mode the state tensors are autograd leaves, so their gradients accumulate over branches.
- `RecomputeContext`: exact mode's reverse sweep; chunk c runs with autograd against views of the
  K/V leaves before it and fresh leaves for the GDN state entering it, and records what it produces
  (its K/V, the GDN state leaving it) so the accumulated gradients can be injected there.
"""

from __future__ import annotations

import torch

from longstraw_mcore.models.mixers.state import AttentionState, GDNState
from longstraw_mcore.prompt_state.containers import AttentionLayerBuffer, PromptState


class _Base:
    collect = False
    store_attention_probs = False

    def __init__(self, state: PromptState, offset: int):
        self.state, self.position_offset = state, offset

    # Megatron only asks these under CUDA-graph inference.
    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return False


class CaptureContext(_Base):
    collect = True

    def __init__(self, state: PromptState, offset: int, keep_boundaries: bool):
        super().__init__(state, offset)
        self.keep_boundaries = keep_boundaries

    def read(self, n: int):
        st = self.state.layers[n]
        if isinstance(st, AttentionLayerBuffer):
            assert st.length == self.position_offset, (n, st.length, self.position_offset)
            return st.view()
        if self.keep_boundaries:
            st.boundaries.append(st.current)  # the state entering this chunk (None for the first)
        return st.current

    def write(self, n: int, new) -> None:
        st = self.state.layers[n]
        if isinstance(st, AttentionLayerBuffer):
            st.append(new)
        else:
            st.current = GDNState(conv=new.conv.detach(), recurrent=new.recurrent.detach())


class ReplayContext(_Base):
    """Reads the state for a branch starting at position `state.length`, batch-expanded to `batch`."""

    def __init__(self, state: PromptState, leaves: dict | None = None, batch: int = 1, store_probs: bool = False):
        super().__init__(state, state.length)
        self.leaves, self.batch = leaves, batch
        self.store_attention_probs = store_probs  # the engine checked they fit its budget

    def read(self, n: int):
        st = self._plain(n) if self.leaves is None else self.leaves[n]
        if isinstance(st, AttentionLayerBuffer):
            st = st.view()  # a fresh view of the leaf buffers per branch graph
        if st is None or self.batch == 1:
            return st
        if isinstance(st, AttentionState):
            return AttentionState(k=st.k.expand(self.batch, -1, -1, -1), v=st.v.expand(self.batch, -1, -1, -1))
        return GDNState(conv=st.conv.expand(self.batch, -1, -1), recurrent=st.recurrent.expand(self.batch, -1, -1, -1))

    def _plain(self, n: int):
        st = self.state.layers[n]
        return st.view() if isinstance(st, AttentionLayerBuffer) else st.current

    def write(self, n: int, new) -> None:  # collect is False: never called
        raise AssertionError("replay must not write the prompt state")


def make_leaves(state: PromptState) -> dict:
    """Exact mode: the state as autograd leaves (K/V buffers themselves; GDN final state)."""
    leaves = {}
    for n, st in state.layers.items():
        if isinstance(st, AttentionLayerBuffer):
            st.k.requires_grad_(True)
            st.v.requires_grad_(True)
            leaves[n] = st
        else:
            cur = st.current
            leaves[n] = None if cur is None else GDNState(conv=cur.conv.detach().requires_grad_(True),
                                                          recurrent=cur.recurrent.detach().requires_grad_(True))
    return leaves


class StateComplete(Exception):
    """Raised by `RecomputeContext` once every local layer has written its state: nothing computed
    after that point feeds a seeded gradient, so the recompute forward stops there."""


class RecomputeContext(_Base):
    collect = True

    def __init__(self, state: PromptState, chunk: int):
        start, _ = state.chunk_bounds[chunk]
        super().__init__(state, start)
        self.chunk = chunk
        self.entry: dict = {}    # GDN layer -> leaf state entering the chunk (None for chunk 0)
        self.produced: dict = {}  # layer -> AttentionState (this chunk's K/V) | GDNState (leaving it)

    def read(self, n: int):
        st = self.state.layers[n]
        if isinstance(st, AttentionLayerBuffer):
            return st.view(upto=self.position_offset)  # views of the leaves: grads land in their .grad
        entering = st.boundaries[self.chunk]
        if entering is not None:
            entering = GDNState(conv=entering.conv.detach().requires_grad_(True),
                                recurrent=entering.recurrent.detach().requires_grad_(True))
        self.entry[n] = entering
        return entering

    def write(self, n: int, new) -> None:
        self.produced[n] = new
        if len(self.produced) == len(self.state.layers):
            raise StateComplete  # the rest of the last layer (and the final norm) is not needed


def ensure_grad(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if t is None else t
