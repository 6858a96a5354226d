"""What every per-layer prompt-state kind provides, and the storage helpers they share.

A state kind (one class per layer kind: attention K/V, GDN conv window + recurrent state; later the
MLA latent, the DSA indexer keys, sequence-sharded K/V) owns, for one local layer:
- allocation (its constructor) and its term of the analytic memory model (`analytic_bytes`,
  `analytic_grad_bytes`: classmethods, so the planner needs no tensors);
- the capture write, the replay read and exact mode's recompute read/record, reached through the
  contexts in contexts.py (attention-like kinds answer `*_keys`, recurrent kinds `*_read/_write`);
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
