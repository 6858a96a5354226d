"""Captured prompt state of one rank: one state-kind object per local layer (prompt_state/base.py),
plus the capture chunk boundaries. Capture writes it; replay only reads it (exact mode also
accumulates its gradient); exact mode's reverse sweep consumes that gradient.

Byte accounting is storage-true: `nbytes_by_type()` counts every storage the kept tensors live in
once (a view that pins a larger buffer counts the whole buffer), and equals `analytic_state_bytes`,
which the planner and the tests share, exactly. Which kind a layer keeps comes from its family's
per-layer-type records (prompt_state/kinds.py), handed in: by the model to `allocate`, by the
caller to the analytic functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw_mcore.config import ModelConfig
from longstraw_mcore.prompt_state.base import storage_bytes


@dataclass
class PromptState:
    layers: dict                   # layer_number -> state kind object (AttentionKV, GDNRecurrentState, ...)
    length: int = 0                # captured positions (of the whole prompt)
    chunk_bounds: list = field(default_factory=list)   # [(start, end)] of capture chunks, prompt positions
    local_bounds: list = field(default_factory=list)   # [(start, end)] of each chunk in this rank's buffers
    # (the same as chunk_bounds without context parallelism; this rank's zig-zag share otherwise)

    def nbytes_by_type(self, where: str | None = None) -> dict[str, int]:
        """Bytes per category; `where`: "host" / "device" only (memory.state_offload puts the staged
        tensors' homes in host memory: memory/staging.py), None: both."""
        from longstraw_mcore.memory.staging import home_tensors

        seen: set[int] = set()
        out: dict[str, int] = {}
        for st in self.layers.values():
            homes = home_tensors(st)
            for cat, tensors in st.kept().items():
                if where is None or (where == "host") == (st.host and cat in homes):
                    n = storage_bytes(list(tensors) + homes.get(cat, []), seen)
                    out[cat] = out.get(cat, 0) + n
        return out

    def nbytes(self) -> int:
        return sum(self.nbytes_by_type().values())

    def grad_nbytes(self) -> int:
        """Exact mode: bytes of the state gradient (accumulators, leaf copies), storage-true, not
        counting storages the state itself already holds."""
        return self.grad_nbytes_where(None)

    def grad_nbytes_where(self, where: str | None) -> int:
        """`grad_nbytes` of the layers whose state lives `where` ("host": memory.state_offload's kinds,
        whose accumulators and leaves are made from their host homes; "device"; None: all)."""
        from longstraw_mcore.memory.staging import home_tensors

        seen: set[int] = set()
        storage_bytes([t for st in self.layers.values() for ts in st.kept().values() for t in ts], seen)
        storage_bytes([t for st in self.layers.values() for ts in home_tensors(st).values() for t in ts], seen)
        return storage_bytes([t for st in self.layers.values() for t in st.grad_tensors()
                              if where is None or (where == "host") == bool(st.host and st.home)], seen)

    def finish_capture(self, layout) -> None:
        for st in self.layers.values():
            st.finish_capture(layout)

    # exact mode, dispatched to every layer's kind
    def enable_grad(self) -> None:
        for st in self.layers.values():
            st.enable_grad()

    def release_grad(self) -> None:
        for st in self.layers.values():
            st.release_grad()

    # `only`: the layer numbers of one model chunk (parallel.vpp > 1: a rank's chunks share one state, and each
    # chunk's sweep runs its own layers' part; replay/pipeline.py), None: every layer of this rank
    def _of(self, only) -> list:
        return list(self.layers.values()) if only is None else [self.layers[n] for n in only]

    def outputs(self, chunk: int, only=None) -> list[torch.Tensor]:
        return [t for st in self._of(only) for t in st.outputs(chunk)]

    def seed_grads(self, chunk: int, only=None) -> list[torch.Tensor]:
        """In the order of `outputs(chunk)`; read at the chunk's backward (prompt_state/base.py)."""
        return [g for st in self._of(only) for g in st.seed_grads(chunk)]

    def finish_chunk(self, chunk: int, only=None) -> None:
        for st in self._of(only):
            st.finish_chunk(chunk)


def allocate(kinds: dict, model_cfg: ModelConfig, tp: int, captured: int, device, batch: int = 1,
             **layout) -> PromptState:
    """Empty state for the given local layers (`kinds`: {layer_number: its LayerKind}), each of its kind.
    `captured`: positions this rank keeps (its share under context parallelism); `layout` (kv: the KV
    group, spans: the capture chunks) is for kinds that shard further."""
    return PromptState(layers={n: k.state(model_cfg, tp, captured, device, batch, **layout) for n, k in kinds.items()})


def analytic_state_bytes(layers: dict, m: ModelConfig, tp: int, captured: int, exact_chunks: int = 0, batch: int = 1,
                         layer_types: list[str] | None = None, cp: int = 1) -> dict[str, int]:
    """Per-rank prompt-state bytes by category for the given layers (default: every layer), from each
    layer kind's formula (`layers`: the family's {layer type: LayerKind}); exact mode (`exact_chunks`
    capture chunks) adds the GDN chunk boundaries. `captured`: the positions this rank holds (with
    `cp` > 1 its share: parallel/cp.py)."""
    out: dict[str, int] = {}
    for t in (m.layer_types if layer_types is None else layer_types):
        for cat, b in layers[t].state.analytic_bytes(m, tp, captured, exact_chunks, batch, cp).items():
            out[cat] = out.get(cat, 0) + b
    return out


def analytic_state_grad_bytes(layers: dict, m: ModelConfig, tp: int, captured: int,
                              layer_types: list[str] | None = None) -> int:
    """Exact mode: bytes of the state gradient while the branches replay."""
    return sum(layers[t].state.analytic_grad_bytes(m, tp, captured) for t in (m.layer_types if layer_types is None
                                                                               else layer_types))
