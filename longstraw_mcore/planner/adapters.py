"""What LoRA / QLoRA changes in a rank's memory (planner/memory.py): the adapter parameters (with their
gradients and optimizer state: the only trainable ones), and the frozen base's projections at
adapter.base_dtype. Counted from the family's adapter sites (adapters/sites.py) as attach builds them:
column projections split B over tp, row projections split A, experts are whole on their EP rank."""

from __future__ import annotations

BASE_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "fp8": 1 + 4 / 128}
"""Bytes per quantized weight: NF4 = 4 bits + a uint8 scale per 64 + a float32 per 256 scales
(torchao, measured 0.5158 on a [4352, 5120] shard); FP8 = 1 byte + a float32 scale per 128."""


_SITES: dict[tuple[str, str], list] = {}


def sites_of(family, m) -> list:
    """The family's adapter sites for model `m`, built once per model (a plan evaluates many prompt
    lengths; GLM-5.2 has ~60,000 sites, one per routed expert and projection)."""
    key = (family.name, repr(m))
    if key not in _SITES:
        _SITES.clear()  # one model at a time
        _SITES[key] = family.checkpoint.adapter_sites(m)
    return _SITES[key]


def _mine(s, layers: range, last_stage: bool) -> bool:
    return last_stage if s.layer is None else s.layer in layers


def _adapter_pairs(sites, cfg, tp: int, layers: range, last_stage: bool):
    """(A elements, B elements, site) of every adapter on this rank's stage, split over tp as attach builds
    them: column projections split B, row projections split A."""
    a = cfg.adapter
    targets = set(a.resolved_targets({s.target: s.shape for s in sites}))
    for s in sites:
        if s.target not in targets or not _mine(s, layers, last_stage):
            continue
        out, n_in = s.shape
        A, B = a.rank * n_in, a.rank * out
        if s.kind == "column":
            B //= tp
        elif s.kind == "row":
            A //= tp
        yield A, B, s


def adapter_params(sites, cfg, tp: int, ep: int, layers: range, last_stage: bool) -> int:
    """This rank's adapter elements (all its experts' on its EP share)."""
    return int(sum((A + B) if s.expert is None else (A + B) / ep
                   for A, B, s in _adapter_pairs(sites, cfg, tp, layers, last_stage)))


def largest_adapter(sites, cfg, tp: int, layers: range, last_stage: bool) -> int:
    """Elements of this rank's largest adapter tensor (one A or B)."""
    return max((max(A, B) for A, B, _ in _adapter_pairs(sites, cfg, tp, layers, last_stage)), default=0)


def projection_params(sites, tp: int, ep: int, layers: range) -> int:
    """This rank's base projection weights (what adapter.base_dtype quantizes; the output layer stays)."""
    n = 0
    for s in sites:
        if s.layer is None or s.layer not in layers:
            continue
        size = s.shape[0] * s.shape[1]
        n += size / ep if s.expert is not None else size / tp
    return int(n)


def largest_projection(sites, tp: int, ep: int, layers: range) -> int:
    """The largest base projection on this rank (a fused one counted whole: linear_fc1 = gate + up), in
    weights: what a quantized base dequantizes for one product."""
    per: dict[str, float] = {}
    for s in sites:
        if s.layer is None or s.layer not in layers:
            continue
        size = s.shape[0] * s.shape[1] / (1 if s.expert is not None else tp)  # an expert is whole on its rank
        for part in s.parts:
            per[part.module] = per.get(part.module, 0) + size * (part.rows[1] - part.rows[0]) / s.shape[0]
    return int(max(per.values(), default=0))


def frozen_base_activation_delta(family, m, cfg_adapter, tp: int, T: int, layer: int,
                                 produce_only: bool = False) -> int:
    """Bytes a Qwen layer's T tokens keep for the backward with adapters on a frozen base, minus what the
    trainable-base formulas (planner/activations.py) count; 0 for other families (their formulas stay
    upper bounds). Listed tensor by tensor with saved_tensors_hooks (tests/unit/test_planner_activations.py):
    a norm whose weight is frozen keeps no normalised tensor for the weight's gradient (Hd x w per token
    each; q_norm and k_norm (Hq + Hkv) x d x w; the gated norm Hv x Dv x e), the decay gate keeps no
    [T, Hv] float for A_log; each adapted projection piece keeps x A^T [T, r] for B's gradient (r x e).
    The projections' inputs are kept either way (the adapter saves the same tensor). Not counted: the
    first layer's input norm keeps less still (its input, the frozen embedding's output, needs no
    gradient): an upper bound's small excess."""
    if not cfg_adapter.enabled or family.name != "qwen3_5":
        return 0
    from longstraw_mcore.planner.activations import _elem

    e = _elem(m.dtype)
    w = max(4, e)
    kind = m.layer_types[layer]
    drop = (1 if produce_only else 2) * m.hidden_size * w
    if kind == "full_attention":
        hq, hkv = m.num_attention_heads // tp, max(1, m.num_key_value_heads // tp)
        drop += (hq + hkv) * m.head_dim * w
    elif kind == "linear_attention":
        hv = m.linear_num_value_heads // tp
        drop += hv * m.linear_value_head_dim * e + hv * w
    sites = sites_of(family, m)
    targets = set(cfg_adapter.resolved_targets({s.target: s.shape for s in sites}))
    pieces = sum(1 for s in sites if s.layer == layer and s.target in targets
                 for part in s.parts if not produce_only or ".mlp." not in part.module)  # produce_only: no MLP
    return T * (pieces * cfg_adapter.rank * e - drop)
