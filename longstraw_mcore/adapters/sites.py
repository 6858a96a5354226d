"""Where each Hugging Face module an adapter may target lives in the Megatron model: the family's
checkpoint table lists its sites (checkpoint/<family>.py `adapter_sites`), adapters/attach.py builds
them. Data only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """The rows [rows[0], rows[1]) of the HF module's output computed by one Megatron projection
    (`module`: its path with global layer numbers, e.g. `decoder.layers.3.mlp.linear_fc1`), at position
    `slot` among the pieces of that projection's output (linear_fc1 = [gate; up]: gate 0, up 1; `fused`:
    the whole output rows of each piece, (F, F); None: one piece)."""

    module: str
    rows: tuple[int, int]
    slot: int = 0
    fused: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Site:
    """One HF module: `name` (e.g. `model.layers.3.mlp.gate_proj`), `target` (its last component, what
    `adapter.targets` names), (out, in) `shape`, the Megatron `kind` of its projections (adapters/lora.py
    KINDS), its `parts`, the global `layer` (None: lm_head), for a routed expert its index, and `weight`: the
    checkpoint's name of its weight where that is not `name.weight` (PEFT names the module as transformers holds
    it in memory, e.g. GLM-5.3's `self_attn.forget_gate.f_a_proj`, stored as `self_attn.f_a_proj.weight`)."""

    name: str
    target: str
    shape: tuple[int, int]
    kind: str
    parts: tuple[Part, ...]
    layer: int | None
    expert: int | None = None
    weight: str | None = None
