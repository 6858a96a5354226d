"""What every per-layer prompt-state kind provides, and the storage helpers they share.

A state kind (one class per layer kind: attention K/V, GDN conv window + recurrent state, the MLA
latent with or without the DSA indexer key; K/V or latents sharded by sequence) owns, for one local
layer:
- allocation (its constructor) and its term of the analytic memory model (`analytic_bytes`,
  `analytic_grad_bytes`, `rows`, `probs_bytes`: classmethods, so the planner needs no tensors);
- the capture write, the replay read and exact mode's recompute read/record, reached through the
  contexts in contexts.py, one family of phase hooks per mixer hook (prompt_state/hooks.py):
  attention-like kinds answer `*_keys`, recurrent kinds `*_read` / `*_write`, latent kinds `*_latent`;
  each is declared below and a kind implements its own family;
- exact mode's gradient accumulators (`enable_grad` / `release_grad`) and the injection of the
  accumulated gradient into a chunk's recompute (`outputs`, `seed_grads`, then `finish_chunk`);
- storage-true byte accounting: `kept()` names the tensors it keeps, `PromptState` counts their
  storages once each (a view that pins a larger buffer counts the whole buffer).
Nothing outside a kind switches on layer type.
"""

from __future__ import annotations

from typing import ClassVar

import torch


class LayerState:
    kind: ClassVar[str] = ""
    staged: ClassVar[tuple[str, ...]] = ()
    """Attributes holding position-sized tensors (rows along dim 1) that memory.state_offload /
    state_dtype=fp8 keep elsewhere between the layer's runs (memory/staging.py)."""
    exact_rows: ClassVar[tuple[str, ...]] = ()
    """Staged attributes memory.state_dtype=fp8 keeps in the model dtype (they feed a discrete choice)."""
    home: dict | None = None   # memory/staging.py: attribute -> (byte category, its home)
    host: bool = False         # the homes (and exact mode's state gradients made from them) are host memory

    def _no(self, hook: str):
        return NotImplementedError(f"the {self.kind or type(self).__name__} state has no {hook} (a mixer called a hook "
                                   "of another state kind)")

    # --- phase hooks of attention-like kinds (the mixer's key_sets) --------------------------------
    def capture_keys(self, k, v, local_offset: int, span: tuple[int, int], merged: bool = True):
        """A capture chunk's K/V (this rank's tokens) -> the key sets its queries attend to."""
        raise self._no("capture_keys")

    def replay_keys(self, k, v, offset: int, store_probs: bool):
        """A branch's own K/V -> the prompt (read in place) and its own keys, the own last."""
        raise self._no("replay_keys")

    def recompute_keys(self, k, v, chunk: int, local_span: tuple[int, int], span: tuple[int, int],
                       deposit_scale: float = 1.0):
        """Exact mode: chunk `chunk`'s recomputed K/V -> the earlier state (with its gradient sink) and its own."""
        raise self._no("recompute_keys")

    # --- phase hooks of recurrent kinds (the mixer's read / write) ----------------------------------
    def capture_read(self, chunk: int, keep_boundary: bool):
        raise self._no("capture_read")

    def capture_write(self, new) -> None:
        raise self._no("capture_write")

    def replay_read(self, batch: int):
        raise self._no("replay_read")

    def recompute_read(self, chunk: int, deposit_scale: float = 1.0):
        raise self._no("recompute_read")

    def recompute_write(self, chunk: int, new) -> None:
        raise self._no("recompute_write")

    # --- phase hooks of latent kinds (the mixer's latent) -------------------------------------------
    def capture_latent(self, own, local_offset: int):
        raise self._no("capture_latent")

    def replay_latent(self, own, own_counted: bool = True):
        raise self._no("replay_latent")

    def recompute_latent(self, own, chunk: int, local_span: tuple[int, int], deposit_scale: float = 1.0):
        raise self._no("recompute_latent")

    # --- bytes and lifecycle --------------------------------------------------------------------------

    def kept(self) -> dict[str, list[torch.Tensor]]:
        """Byte category -> tensors this layer keeps after capture."""
        raise NotImplementedError

    def grad_tensors(self) -> list[torch.Tensor]:
        """Exact mode: the extra tensors of the state gradient (accumulators, leaf copies)."""
        return []

    def finish_capture(self, layout) -> None:
        """After the last capture chunk (`layout`: the CP layout, or None)."""

    def enable_grad(self) -> None:
        """Exact mode, before the first branch: start accumulating the state gradient."""

    def release_grad(self) -> None:
        """After the prompt backward: the state gradient is spent."""

    def outputs(self, chunk: int) -> list[torch.Tensor]:
        """Exact mode: the tensors the recompute of `chunk` produced (the state it rebuilds)."""
        raise NotImplementedError

    def seed_grads(self, chunk: int) -> list[torch.Tensor]:
        """Exact mode: the accumulated gradients of `outputs(chunk)`, read when the chunk's backward
        starts (every branch and every later chunk has deposited by then). Records are per chunk:
        a pipeline stage may recompute chunk c-1 before it runs chunk c's backward."""
        raise NotImplementedError

    def finish_chunk(self, chunk: int) -> None:
        """After the backward of `chunk`'s recompute."""

    @classmethod
    def analytic_bytes(cls, m, tp: int, captured: int, exact_chunks: int, batch: int = 1, cp: int = 1) -> dict[str, int]:
        """Bytes this rank keeps for one layer: `captured` positions of its own (under context
        parallelism its share), `exact_chunks` capture chunks in exact mode, `cp` ranks."""
        raise NotImplementedError

    @classmethod
    def analytic_grad_bytes(cls, m, tp: int, captured: int) -> int:
        return 0

    @classmethod
    def rows(cls, captured: int, tp: int) -> int:
        """Prompt positions a call's queries read on one TP rank (the planner's count of the keys a layer
        sees): all of this rank's `captured` unless the kind stripes them over TP."""
        return captured

    @classmethod
    def probs_bytes(cls, m, tp: int, batch: int, tokens: int, captured: int) -> int:
        """A branch's attention probabilities over the prompt when kept for the backward (attention kinds)."""
        return 0


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """State gradients accumulate in float32 (float64 for float64 states): bf16 sums over many
    branches and chunks would lose the small terms."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, in a storage of exactly its own size (a view into a larger buffer, e.g. the conv
    window inside a chunk's padded input, would pin that whole buffer)."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    out = t.clone(memory_format=torch.contiguous_format)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size(), (t.shape, out.stride())
    return out


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (the analytic memory terms of every kind)."""
    return torch.empty(0, dtype=dtype).element_size()


def storage_bytes(tensors, seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each counted once, also across calls with the
    same `seen`); what memory really holds, not what the views show."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total
