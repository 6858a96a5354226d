"""Hugging Face <-> Megatron mapping for the Qwen3.5/3.6 text decoder: one table, both directions.

Megatron names are the *canonical* keys of `model.sharded_state_dict()`: TP-independent, global
layer numbers, full (unsharded) tensors. Each rule maps a tuple of HF tensors to a tuple of Megatron
tensors through a named transform and its inverse; `hf_to_mcore` and `mcore_to_hf` both read the
same table, so a round trip is bit-exact by construction (only views, cat and split; no casts).

    transform        HF -> Megatron                                  why
    identity         x -> x
    concat_rows      (gate_proj, up_proj) -> linear_fc1              Megatron's SwiGLU fc1 is [gate; up]
    split_rows       in_proj_qkv -> (in_proj_q, in_proj_k, in_proj_v) per-head TP slices of q/k/v must
                                                                     be contiguous (see gated_deltanet.py)
    split_conv       conv1d.weight [C,1,W] -> (conv_q, conv_k, conv_v) [c,W] same, for the conv channels
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from longstraw_mcore.checkpoint.common import CheckpointError, shape_of  # noqa: F401 - re-exported
from longstraw_mcore.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]
    mcore: tuple[str, ...]
    transform: str


def _sizes(m: ModelConfig) -> list[int]:
    key_dim = m.linear_num_key_heads * m.linear_key_head_dim
    return [key_dim, key_dim, m.linear_num_value_heads * m.linear_value_head_dim]


def _forward(transform: str, m: ModelConfig) -> Callable[[list], list]:
    if transform == "identity":
        return lambda xs: list(xs)
    if transform == "concat_rows":
        return lambda xs: [torch.cat(xs, dim=0)]
    if transform == "split_rows":
        return lambda xs: list(torch.split(xs[0], _sizes(m), dim=0))
    if transform == "split_conv":
        return lambda xs: [t.squeeze(1) for t in torch.split(xs[0], _sizes(m), dim=0)]
    raise KeyError(transform)


def _inverse(transform: str, m: ModelConfig, hf_rows: list[int]) -> Callable[[list], list]:
    if transform == "identity":
        return lambda xs: list(xs)
    if transform == "concat_rows":
        return lambda xs: list(torch.split(xs[0], hf_rows, dim=0))
    if transform == "split_rows":
        return lambda xs: [torch.cat(xs, dim=0)]
    if transform == "split_conv":
        return lambda xs: [torch.cat([t.unsqueeze(1) for t in xs], dim=0)]
    raise KeyError(transform)


def rules(m: ModelConfig) -> list[Rule]:
    out = [
        Rule(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), "identity"),
        Rule(("model.norm.weight",), ("decoder.final_layernorm.weight",), "identity"),
        Rule(("lm_head.weight",), ("output_layer.weight",), "identity"),
    ]
    for i, kind in enumerate(m.layer_types):
        h, g = f"model.layers.{i}.", f"decoder.layers.{i}."
        out += [
            Rule((h + "input_layernorm.weight",), (g + "input_layernorm.weight",), "identity"),
            Rule((h + "post_attention_layernorm.weight",), (g + "pre_mlp_layernorm.weight",), "identity"),
            Rule((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), (g + "mlp.linear_fc1.weight",), "concat_rows"),
            Rule((h + "mlp.down_proj.weight",), (g + "mlp.linear_fc2.weight",), "identity"),
        ]
        a, s = h + "self_attn.", g + "self_attention."
        if kind == "full_attention":
            out += [Rule((a + x + ".weight",), (s + y + ".weight",), "identity") for x, y in (
                ("q_proj", "linear_q"), ("k_proj", "linear_k"), ("v_proj", "linear_v"), ("o_proj", "linear_proj"),
                ("q_norm", "q_norm"), ("k_norm", "k_norm"))]
        else:
            a = h + "linear_attn."
            out += [
                Rule((a + "in_proj_qkv.weight",), (s + "in_proj_q.weight", s + "in_proj_k.weight",
                                                   s + "in_proj_v.weight"), "split_rows"),
                Rule((a + "conv1d.weight",), (s + "conv_q", s + "conv_k", s + "conv_v"), "split_conv"),
            ]
            out += [Rule((a + x,), (s + x,), "identity") for x in (
                "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias", "norm.weight",
                "out_proj.weight")]
    return out


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a `Qwen3_5ForCausalLM` checkpoint of this config holds."""
    H, V, F = m.hidden_size, m.vocab_size, m.intermediate_size
    kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i, kind in enumerate(m.layer_types):
        h = f"model.layers.{i}."
        shapes.update({h + "input_layernorm.weight": (H,), h + "post_attention_layernorm.weight": (H,),
                       h + "mlp.gate_proj.weight": (F, H), h + "mlp.up_proj.weight": (F, H),
                       h + "mlp.down_proj.weight": (H, F)})
        if kind == "full_attention":
            a, D = h + "self_attn.", m.head_dim
            shapes.update({a + "q_proj.weight": (m.num_attention_heads * D * 2, H),
                           a + "k_proj.weight": (m.num_key_value_heads * D, H),
                           a + "v_proj.weight": (m.num_key_value_heads * D, H),
                           a + "o_proj.weight": (H, m.num_attention_heads * D),
                           a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
        else:
            a, nv = h + "linear_attn.", m.linear_num_value_heads
            shapes.update({a + "in_proj_qkv.weight": (2 * kd + vd, H), a + "in_proj_z.weight": (vd, H),
                           a + "in_proj_b.weight": (nv, H), a + "in_proj_a.weight": (nv, H),
                           a + "conv1d.weight": (2 * kd + vd, 1, m.linear_conv_kernel_dim),
                           a + "A_log": (nv,), a + "dt_bias": (nv,),
                           a + "norm.weight": (m.linear_value_head_dim,), a + "out_proj.weight": (H, vd)})
    return shapes


def check_hf_tensors(tensors: Mapping, m: ModelConfig, where: str = "checkpoint") -> None:
    expected = hf_shapes(m)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing tensor(s) {missing[:5]}{more}")
    for k, shape in expected.items():
        if shape_of(tensors, k) != shape:
            raise CheckpointError(f"{where}: tensor {k} has shape {shape_of(tensors, k)}, expected {shape} "
                                  f"for this config")


class LazyCanonical(Mapping):
    """Canonical Megatron tensors computed on access from (possibly lazy) HF tensors, one rule at a
    time: loading a sharded model reads each HF tensor once and holds at most one rule's tensors.

    `read(key, slices)` reads only a slice of a canonical tensor, mapped through its rule to slices
    of the HF tensors (a rank reads just its shard when the source reads slices: `SafetensorsDir`)."""

    def __init__(self, hf: Mapping, m: ModelConfig, where: str = "checkpoint"):
        check_hf_tensors(hf, m, where)
        self._hf, self._m = hf, m
        self._rule_of = {k: r for r in rules(m) for k in r.mcore}
        self._cache: tuple[Rule | None, dict] = (None, {})

    def __getitem__(self, key: str) -> torch.Tensor:
        r = self._rule_of[key]
        if self._cache[0] is not r:
            outs = _forward(r.transform, self._m)([self._hf[k] for k in r.hf])
            self._cache = (r, dict(zip(r.mcore, outs)))
        return self._cache[1][key]

    def read(self, key: str, sl: tuple[slice, ...]) -> torch.Tensor:
        r = self._rule_of[key]
        j = r.mcore.index(key)
        rows, rest = sl[0], tuple(sl[1:])
        if r.transform == "identity":
            return _hf_read(self._hf, r.hf[j], sl)
        if r.transform in ("split_rows", "split_conv"):  # canonical piece j = HF rows [off_j, off_j + n_j)
            off = sum(_sizes(self._m)[:j])
            hf_rows = slice(off + rows.start, off + rows.stop)
            if r.transform == "split_rows":
                return _hf_read(self._hf, r.hf[0], (hf_rows,) + rest)
            return _hf_read(self._hf, r.hf[0], (hf_rows, slice(0, 1)) + rest).squeeze(1)
        if r.transform == "concat_rows":  # canonical rows [0, n0) from HF tensor 0, [n0, n0 + n1) from 1
            parts, start = [], 0
            for name in r.hf:
                n = shape_of(self._hf, name)[0]
                a, b = max(rows.start, start), min(rows.stop, start + n)
                if a < b:
                    parts.append(_hf_read(self._hf, name, (slice(a - start, b - start),) + rest))
                start += n
            return torch.cat(parts, 0)
        raise KeyError(r.transform)

    def shape(self, key: str) -> tuple[int, ...]:
        r = self._rule_of[key]
        shapes = [shape_of(self._hf, k) for k in r.hf]
        if r.transform == "identity":
            return shapes[r.mcore.index(key)]
        if r.transform == "concat_rows":
            return (sum(s[0] for s in shapes),) + shapes[0][1:]
        rows = _sizes(self._m)[r.mcore.index(key)]
        return (rows,) + (shapes[0][1:] if r.transform == "split_rows" else shapes[0][2:])

    def __contains__(self, key) -> bool:  # Mapping's default would compute (read) the tensor
        return key in self._rule_of

    def __iter__(self):
        return iter(self._rule_of)

    def __len__(self) -> int:
        return len(self._rule_of)


def _hf_read(hf: Mapping, name: str, sl: tuple[slice, ...]) -> torch.Tensor:
    return hf.read(name, sl) if hasattr(hf, "read") else hf[name][sl]


def hf_to_mcore(hf: Mapping, m: ModelConfig, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF text-decoder tensors (names as in `Qwen3_5ForCausalLM`) -> canonical Megatron tensors."""
    lazy = LazyCanonical(hf, m, where)
    return {k: lazy[k] for k in lazy}


def mcore_to_hf(mc: dict[str, torch.Tensor], m: ModelConfig, only: Rule | None = None) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors -> HF tensors (every rule, or `only` one of them)."""
    out = {}
    F = m.intermediate_size
    for r in ([only] if only is not None else rules(m)):
        missing = [k for k in r.mcore if k not in mc]
        if missing:
            raise CheckpointError(f"Megatron state: missing tensor(s) {missing}")
        for k, t in zip(r.hf, _inverse(r.transform, m, [F, F])([mc[k] for k in r.mcore])):
            out[k] = t.contiguous()
    return out
