"""One rank's weights as the planner counts them (planner/memory.py's `weights` term): the elements of each
checkpoint tensor's part on a rank (split as the model splits it), the parameters of a pipeline stage's
rank, the largest trainable tensor, and the weight bytes with adapters (the frozen base at
adapter.base_dtype)."""

from __future__ import annotations

import math

from longstraw_mcore.planner.activations import _elem
from longstraw_mcore.planner.memo import kept


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def rank_tensor_sizes(family, m, tp: int, ep: int, stage_layers: list[int], stage: int) -> list[int]:
    """The elements of each checkpoint tensor's part on one rank of pipeline stage `stage` (split as the
    model splits them; the vocabulary padded as the model pads it)."""
    first = sum(stage_layers[:stage])
    mine = range(first, first + stage_layers[stage])
    out = []
    for name, shape in family.checkpoint.hf_shapes(m).items():
        layer = _layer_of(name)
        if layer is None:
            if name.startswith("model.embed_tokens") and stage != 0:
                continue
            last = stage == len(stage_layers) - 1
            if (name.startswith(("lm_head", "score.")) or name == "model.norm.weight") and not last:
                continue
            if name.startswith(("model.embed_tokens", "lm_head")):
                out.append(m.padded_vocab_size(tp) * shape[1] // tp)
                continue
            if name.startswith("score."):  # a critic's / reward model's scalar head: whole on every TP rank
                out.append(math.prod(shape))
                continue
        elif layer not in mine:
            continue
        size = math.prod(shape)
        if ".mlp.experts." in name:
            out.append(size // ep)  # experts whole on their EP rank
        elif len(shape) == 1 or ".gate.weight" in name or "indexer." in name:
            out.append(size)        # vectors, the router and the indexer are replicated over TP
        else:
            out.append(size // tp)
    return out


def rank_params(family, m, tp: int, ep: int, stage_layers: list[int], stage: int) -> int:
    """Parameters on one rank of pipeline stage `stage` (rank_tensor_sizes summed)."""
    return sum(rank_tensor_sizes(family, m, tp, ep, stage_layers, stage))


def largest_trainable(family, cfg, stages: list[int], s: int) -> int:
    """Elements of the largest trainable tensor on one rank of stage `s` (an adapter's A or B with
    adapters; a fused checkpoint pair counts as its parts, an upper bound's small miss)."""
    m, p = cfg.model, cfg.parallel
    if cfg.adapter.enabled:
        from longstraw_mcore.planner.adapters import largest_adapter, sites_of

        first = sum(stages[:s])
        return largest_adapter(sites_of(family, m), cfg, p.tp, range(first, first + stages[s]),
                               s == len(stages) - 1)
    return kept(("largest", family.name, repr(m), p.tp, p.ep, tuple(stages), s),
                lambda: max(rank_tensor_sizes(family, m, p.tp, p.ep, stages, s), default=0))


def stage_weights(family, cfg, stages: list[int], s: int) -> tuple[int, int]:
    """(weight bytes, trainable parameters n) of one rank of stage `s`: every parameter at e, or with
    adapters the frozen base (projections at adapter.base_dtype) and the adapters. Kept per (model,
    adapter, tp, ep, stages): `plan --suggest` plans thousands of switch settings on a few layouts."""
    p = cfg.parallel
    return kept(("weights", family.name, repr(cfg.model), repr(cfg.adapter), p.tp, p.ep, tuple(stages), s),
                lambda: _stage_weights(family, cfg, stages, s))


def _stage_weights(family, cfg, stages: list[int], s: int) -> tuple[int, int]:
    m, p = cfg.model, cfg.parallel
    e = _elem(m.dtype)
    first = sum(stages[:s])
    layers = range(first, first + stages[s])
    n = rank_params(family, m, p.tp, p.ep, stages, s)
    weights = n * e
    if cfg.adapter.enabled:  # only the adapters train; the base's projections at adapter.base_dtype
        from longstraw_mcore.planner.adapters import BASE_BYTES, adapter_params, projection_params, sites_of

        sites = sites_of(family, m)
        proj = projection_params(sites, p.tp, p.ep, layers)
        kind = cfg.adapter.base_dtype
        base = (n - proj) * e + int(proj * (BASE_BYTES[kind] if kind in BASE_BYTES else e))
        n = adapter_params(sites, cfg, p.tp, p.ep, layers, s == len(stages) - 1)
        weights = base + n * e
    return weights, n
