"""Where a rank's prompt state lives, and in what form, under the `memory` section (config/memory.py):
the planner's side of memory/staging.py (state_offload, one layer staged at a time) and memory/fp8.py
(state_dtype=fp8). planner/memory.py adds these terms to a rank's device and host bytes.

The state kinds' byte categories (prompt_state/*.py `analytic_bytes`) are of two sorts:

    staged     attention_kv, mla_latent, dsa_index_keys: one row per prompt position this rank holds.
               state_offload keeps them in host memory; state_dtype=fp8 stores them as fp8 blocks (on
               the host with state_offload, on the device otherwise). Either way (both need
               recompute=layer) a layer's rows are copied to the device in the model dtype only while
               that layer runs, so the device holds one layer's staged state on top (`staging_bytes`)
    resident   gdn_state, gdn_chunk_boundaries (Gated DeltaNet: a fixed size per layer, per chunk in
               exact mode): on the device, in its own dtype, whatever the switches

A kind with staged categories also keeps its exact-mode gradient (analytic_grad_bytes: the attention
K/V accumulators, the MLA leaves and their gradients) in host memory with state_offload; a resident
kind's gradient (Gated DeltaNet's state leaves) stays on the device.

fp8 bytes: memory/fp8.py stores each tensor of a category as rows of its own values, so a category's
bytes are sum over its tensors of fp8_nbytes(rows, v) = rows x ceil(v / 128) x (128 + 4), where

    attention_kv   K and V apart: v = Hk_local x head_dim each (Hk_local = max(Hk / tp, 1)), rows = the
                   positions this rank holds
    mla_latent     c: v = kv_lora_rank, pe: v = qk_rope_head_dim; rows = this rank's TP stripe
    dsa_index_keys ik: v = index_head_dim, rows as mla_latent

(rows from the kind's own `rows`), except a tensor the kind names in `exact_rows`, which memory/staging.py
keeps in the model dtype (rows x v x e): today MLA's index keys `ik` (they decide the discrete top-k;
rounding them flipped selections). Each category is checked against the kind's model-dtype bytes
(rows x sum of v x e), so a kind whose formula changes without this table fails loudly here.
"""

from __future__ import annotations

from longstraw_mcore.planner.activations import _elem

STAGED = ("attention_kv", "mla_latent", "dsa_index_keys")
"""The position-sized categories that memory.state_offload / state_dtype=fp8 move or shrink."""

_FP8_TENSORS = {
    "attention_kv": lambda m, tp: [("k", max(m.num_key_value_heads // tp, 1) * m.head_dim),
                                   ("v", max(m.num_key_value_heads // tp, 1) * m.head_dim)],
    "mla_latent": lambda m, tp: [("c", m.kv_lora_rank), ("pe", m.qk_rope_head_dim)],
    "dsa_index_keys": lambda m, tp: [("ik", m.index_head_dim)],
}
"""Category -> (the kind's attribute, values per row) of each of its tensors (memory/fp8.py blocks each
tensor's rows apart)."""


def _layer_bytes(kind, m, tp: int, captured: int, exact_chunks: int, cp: int) -> dict[str, int]:
    return kind.state.analytic_bytes(m, tp, captured, exact_chunks, 1, cp)


def is_staged(kind, m) -> bool:
    """Whether the kind keeps position-sized state (one of STAGED), i.e. it moves with state_offload."""
    return any(c in STAGED for c in _layer_bytes(kind, m, 1, 1, 0, 1))


def fp8_bytes(kind, m, tp: int, captured: int, category: str, model_bytes: int) -> int:
    """One layer's `category` stored as fp8 blocks (see the module docstring); `model_bytes`: the same in
    the model dtype, as the kind counts it (checked against the table)."""
    from longstraw_mcore.memory.fp8 import fp8_nbytes

    if category not in _FP8_TENSORS:
        raise ValueError(f"state category {category!r} has no fp8 layout; staged categories: {list(_FP8_TENSORS)}")
    rows, tensors, e = kind.state.rows(captured, tp), _FP8_TENSORS[category](m, tp), _elem(m.dtype)
    values = [v for _, v in tensors]
    if rows * sum(values) * e != model_bytes:
        raise ValueError(f"{category}: {rows} rows x {values} values x {e} B = {rows * sum(values) * e} B, but the "
                         f"state kind counts {model_bytes} B: planner/state.py's fp8 table no longer matches "
                         "prompt_state/")
    exact = getattr(kind.state, "exact_rows", ())
    return sum(rows * v * e if name in exact else fp8_nbytes(rows, v) for name, v in tensors)


def state_homes(layers: dict, m, mem, tp: int, captured: int, exact_chunks: int, types: list[str],
                cp: int) -> tuple[int, int]:
    """(device bytes, host bytes) of the prompt state of the layers of `types` (one entry per layer) on
    one rank: staged categories in fp8 with state_dtype=fp8, on the host with state_offload."""
    device = host = 0
    for t in types:
        for cat, b in _layer_bytes(layers[t], m, tp, captured, exact_chunks, cp).items():
            if cat not in STAGED:
                device += b
                continue
            if mem.state_dtype == "fp8":
                b = fp8_bytes(layers[t], m, tp, captured, cat, b)
            if mem.state_offload:
                host += b
            else:
                device += b
    return device, host


def grad_homes(layers: dict, m, mem, tp: int, captured: int, types: list[str]) -> tuple[int, int]:
    """Exact mode: (device bytes, host bytes) of the state gradient of the layers of `types`: a staged
    kind's on the host with state_offload, the rest on the device."""
    device = host = 0
    for t in types:
        b = layers[t].state.analytic_grad_bytes(m, tp, captured)
        if mem.state_offload and is_staged(layers[t], m):
            host += b
        else:
            device += b
    return device, host


def staging_bytes(layers: dict, m, mem, tp: int, captured: int, types: list[str], cp: int) -> int:
    """The one layer's staged state (model dtype) on the device while it runs: the largest of the
    layer types in `types`; 0 without state_offload and fp8 state."""
    if not mem.stages_state:
        return 0
    return max((sum(b for c, b in _layer_bytes(layers[t], m, tp, captured, 0, cp).items() if c in STAGED)
                for t in set(types)), default=0)
