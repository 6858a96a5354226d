"""The three ways a model run meets the prompt state (passed as the mixers' `inference_context`).

Mixers call one hook per mixer type and never see which context they run under:
attention-like mixers `ctx.key_sets(layer, k, v)` (-> the key sets to attend to), recurrent mixers
`ctx.read(layer)` (-> the state entering this call) and `ctx.write(layer, state)` (the state after
it). Each context forwards the hook to that layer's state kind for its phase:

- `CaptureContext`: a no-grad prompt chunk; kinds store what later tokens need (exact mode: GDN
  kinds also record the state entering the chunk).
- `ReplayContext`: a branch after the whole prompt; kinds hand out the state read-only (in exact mode
  with gradient accumulators / leaves); `write` is a no-op: a branch's own K/V and recurrent
  updates are scratch of its graph, freed with it.
- `RecomputeContext`: exact mode's reverse sweep, chunk c with autograd against the state before
  it; kinds record what the chunk produces, to be seeded with the accumulated gradient.
"""

from __future__ import annotations

from longstraw_mcore.prompt_state.containers import PromptState


class _Base:
    def __init__(self, state: PromptState, offset: int):
        self.state, self.position_offset = state, offset

    # Megatron only asks these under CUDA-graph inference.
    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return False


class CaptureContext(_Base):
    def __init__(self, state: PromptState, chunk: int, span: tuple[int, int], keep_boundaries: bool):
        super().__init__(state, span[0])
        self.chunk, self.keep_boundaries = chunk, keep_boundaries

    def key_sets(self, n: int, k, v):
        return self.state.layers[n].capture_keys(k, v, self.position_offset)

    def read(self, n: int):
        return self.state.layers[n].capture_read(self.chunk, self.keep_boundaries)

    def write(self, n: int, new) -> None:
        self.state.layers[n].capture_write(new)


class ReplayContext(_Base):
    """A branch (or a batch of `batch` branches) starting at position `state.length`."""

    def __init__(self, state: PromptState, batch: int = 1, store_probs: bool = False):
        super().__init__(state, state.length)
        self.batch, self.store_probs = batch, store_probs  # store_probs: the engine checked they fit

    def key_sets(self, n: int, k, v):
        return self.state.layers[n].replay_keys(k, v, self.position_offset, self.store_probs)

    def read(self, n: int):
        return self.state.layers[n].replay_read(self.batch)

    def write(self, n: int, new) -> None:
        pass  # the branch's own state is scratch of its graph


class RecomputeContext(_Base):
    def __init__(self, state: PromptState, chunk: int):
        self.span = state.chunk_bounds[chunk]
        super().__init__(state, self.span[0])
        self.chunk = chunk

    def key_sets(self, n: int, k, v):
        return self.state.layers[n].recompute_keys(k, v, self.span)

    def read(self, n: int):
        return self.state.layers[n].recompute_read(self.chunk)

    def write(self, n: int, new) -> None:
        self.state.layers[n].recompute_write(new)
