"""Hugging Face <-> Megatron mapping for the Qwen3.5/3.6 text decoder: one table (checkpoint/rule_table.py),
both directions, bit-exact round trip.

    transform        HF -> Megatron                                  why
    identity         x -> x
    concat_rows      (gate_proj, up_proj) -> linear_fc1              Megatron's SwiGLU fc1 is [gate; up]
    split_rows       in_proj_qkv -> (in_proj_q, in_proj_k, in_proj_v) per-head TP slices of q/k/v must
                                                                     be contiguous (see gated_deltanet.py)
    split_conv       conv1d.weight [C,1,W] -> (conv_q, conv_k, conv_v) [c,W] same, for the conv channels
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from longstraw_mcore.checkpoint import rule_table
from longstraw_mcore.checkpoint.common import CheckpointError, shape_of  # noqa: F401 - re-exported
from longstraw_mcore.checkpoint.rule_table import Rule
from longstraw_mcore.config import ModelConfig


def _sizes(m: ModelConfig) -> tuple[int, ...]:
    key_dim = m.linear_num_key_heads * m.linear_key_head_dim
    return (key_dim, key_dim, m.linear_num_value_heads * m.linear_value_head_dim)


def rules(m: ModelConfig) -> list[Rule]:
    F, sizes = m.intermediate_size, _sizes(m)
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
            Rule((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), (g + "mlp.linear_fc1.weight",), "concat_rows", (F, F)),
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
                                                   s + "in_proj_v.weight"), "split_rows", sizes),
                Rule((a + "conv1d.weight",), (s + "conv_q", s + "conv_k", s + "conv_v"), "split_conv", sizes),
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
    rule_table.check_hf_tensors(tensors, hf_shapes(m), where)


def skipped_names(names, m: ModelConfig) -> list[str]:
    """HF names that are not this decoder's and are dropped with a note (none: the vision tower and
    MTP weights of the published checkpoints are already set aside by the directory reader)."""
    return []


class LazyCanonical(rule_table.LazyCanonical):
    """Canonical tensors read on access (`read(key, slices)`: only a rank's shard), from the table."""

    def __init__(self, hf: Mapping, m: ModelConfig, where: str = "checkpoint"):
        super().__init__(hf, rules(m), hf_shapes(m), where)


def hf_to_mcore(hf: Mapping, m: ModelConfig, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF text-decoder tensors (names as in `Qwen3_5ForCausalLM`) -> canonical Megatron tensors."""
    lazy = LazyCanonical(hf, m, where)
    return {k: lazy[k] for k in lazy}


def mcore_to_hf(mc: dict[str, torch.Tensor], m: ModelConfig, only: Rule | None = None) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors -> HF tensors (every rule, or `only` one of them)."""
    return rule_table.to_hf(mc, [only] if only is not None else rules(m))
