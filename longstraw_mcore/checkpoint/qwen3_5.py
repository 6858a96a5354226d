"""Hugging Face <-> Megatron for the Qwen3.5/3.6 text decoder: its `config.json` (read and written), the
names of its stored tensors, and one mapping table (checkpoint/rule_table.py), both directions,
bit-exact round trip.

Accepted forms: the text-only `Qwen3_5ForCausalLM` (decoder under `model.*`) and the published
`Qwen3_5ForConditionalGeneration` (decoder under `model.language_model.*`, `text_config` nested, plus
a vision tower `model.visual.*` and `mtp.*` weights, which are skipped and reported: `tensor_name`).
Written directories are the text-only form.

    transform        HF -> Megatron                                  why
    identity         x -> x
    concat_rows      (gate_proj, up_proj) -> linear_fc1              Megatron's SwiGLU fc1 is [gate; up]
    split_rows       in_proj_qkv -> (in_proj_q, in_proj_k, in_proj_v) per-head TP slices of q/k/v must
                                                                     be contiguous (see gated_deltanet.py)
    split_conv       conv1d.weight [C,1,W] -> (conv_q, conv_k, conv_v) [c,W] same, for the conv channels
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from longstraw_mcore.adapters.sites import Part, Site
from longstraw_mcore.checkpoint import rule_table
from longstraw_mcore.checkpoint.common import CheckpointError, config_dtype, read_config_json
from longstraw_mcore.checkpoint.rule_table import Rule
from longstraw_mcore.config import Qwen35Config

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
HEADS = {"token_value": ("Qwen3_5ForTokenClassification",),
         "sequence_score": ("Qwen3_5ForSequenceClassification", "Qwen3_5TextForSequenceClassification")}
"""A critic's and a reward model's architectures (checkpoint/heads.py)."""
_REQUIRED = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")


def _sizes(m: Qwen35Config) -> tuple[int, ...]:
    key_dim = m.linear_num_key_heads * m.linear_key_head_dim
    return (key_dim, key_dim, m.linear_num_value_heads * m.linear_value_head_dim)


def rules(m: Qwen35Config) -> list[Rule]:
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


def hf_shapes(m: Qwen35Config) -> dict[str, tuple[int, ...]]:
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


def adapter_sites(m: Qwen35Config) -> list[Site]:
    """Every projection an adapter may target (adapters/sites.py), in the order PEFT lists modules."""
    shapes = m.projection_shapes()

    def site(name, target, kind, parts, layer):
        return Site(name, target, shapes[target], kind, tuple(parts), layer)

    out = []
    for i, kind in enumerate(m.layer_types):
        h, g = f"model.layers.{i}.", f"decoder.layers.{i}."
        s = g + "self_attention."
        if kind == "full_attention":
            for x, y, k in (("q_proj", "linear_q", "column"), ("k_proj", "linear_k", "column"),
                            ("v_proj", "linear_v", "column"), ("o_proj", "linear_proj", "row")):
                out.append(site(h + "self_attn." + x, x, k, [Part(s + y, (0, shapes[x][0]))], i))
        else:
            a = h + "linear_attn."
            kd, _, vd = _sizes(m)
            out.append(site(a + "in_proj_qkv", "in_proj_qkv", "column",
                            [Part(s + "in_proj_q", (0, kd)), Part(s + "in_proj_k", (kd, 2 * kd)),
                             Part(s + "in_proj_v", (2 * kd, 2 * kd + vd))], i))
            for x in ("in_proj_z", "in_proj_b", "in_proj_a"):
                out.append(site(a + x, x, "column", [Part(s + x, (0, shapes[x][0]))], i))
            out.append(site(a + "out_proj", "out_proj", "row", [Part(s + "out_proj", (0, shapes["out_proj"][0]))], i))
        F = m.intermediate_size
        out += [site(h + "mlp.gate_proj", "gate_proj", "column", [Part(g + "mlp.linear_fc1", (0, F), 0, (F, F))], i),
                site(h + "mlp.up_proj", "up_proj", "column", [Part(g + "mlp.linear_fc1", (0, F), 1, (F, F))], i),
                site(h + "mlp.down_proj", "down_proj", "row", [Part(g + "mlp.linear_fc2", (0, m.hidden_size))], i)]
    out.append(site("lm_head", "lm_head", "column", [Part("output_layer", (0, m.vocab_size))], None))
    return out


def check_hf_tensors(tensors: Mapping, m: Qwen35Config, where: str = "checkpoint") -> None:
    rule_table.check_hf_tensors(tensors, hf_shapes(m), where)


def skipped_names(names, m: Qwen35Config) -> list[str]:
    """HF names that are not this decoder's and are dropped with a note (none: the vision tower and
    MTP weights of the published checkpoints are already set aside by the directory reader)."""
    return []


class LazyCanonical(rule_table.LazyCanonical):
    """Canonical tensors read on access (`read(key, slices)`: only a rank's shard), from the table."""

    def __init__(self, hf: Mapping, m: Qwen35Config, where: str = "checkpoint"):
        super().__init__(hf, rules(m), hf_shapes(m), where)


def hf_to_mcore(hf: Mapping, m: Qwen35Config, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF text-decoder tensors (names as in `Qwen3_5ForCausalLM`) -> canonical Megatron tensors."""
    lazy = LazyCanonical(hf, m, where)
    return {k: lazy[k] for k in lazy}


def mcore_to_hf(mc: dict[str, torch.Tensor], m: Qwen35Config, only: Rule | None = None) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors -> HF tensors (every rule, or `only` one of them)."""
    return rule_table.to_hf(mc, [only] if only is not None else rules(m))


# ---------------------------------------------------------------------------------------------
# config.json and the stored names


def read_config(path: str | Path) -> tuple[Qwen35Config, dict]:
    """`config.json` -> (Qwen35Config, raw dict). Raises CheckpointError for other architectures."""
    d = Path(path)
    raw, cfg_file = read_config_json(d, ARCHITECTURES + sum(HEADS.values(), ()))
    text = raw.get("text_config", raw)
    missing = [k for k in _REQUIRED if k not in text]
    if missing:
        where = "text_config" if "text_config" in raw else "config.json"
        raise CheckpointError(f"{cfg_file}: {where} lacks required field(s) {missing}")
    if text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)):
        raise CheckpointError(f"{d}: tie_word_embeddings=true; the Qwen3.6 family has an untied lm_head")
    n = text["num_hidden_layers"]
    types = text.get("layer_types")
    interval = text.get("full_attention_interval", 4)
    if types is not None:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if not full or any(t not in ("full_attention", "linear_attention") for t in types):
            raise CheckpointError(f"{d}: layer_types {types} is not a Gated DeltaNet / full attention pattern")
        interval = full[0] + 1
        regular = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        if types != regular:
            raise CheckpointError(f"{d}: layer_types is not periodic (every {interval}th layer full attention); "
                                  "irregular layer patterns are not supported")
    rope = text.get("rope_parameters") or {}
    dtype = config_dtype(cfg_file, text, raw)
    m = Qwen35Config(
        family="qwen3_5", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_layers=n, full_attention_interval=interval,
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
        linear_num_key_heads=text["linear_num_key_heads"], linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        dtype=dtype,
    )
    return m, raw


def hf_config_dict(m: Qwen35Config) -> dict:
    """A `Qwen3_5ForCausalLM` config.json for this model."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim, "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": False, "attention_bias": False,
        "layer_types": m.layer_types, "full_attention_interval": m.full_attention_interval,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim, "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        "dtype": m.dtype,
    }


def tensor_name(key: str) -> str | None:
    """A stored key under its `Qwen3_5ForCausalLM` name, or None when it is not the text decoder's (the
    published VLM form keeps the decoder under `model.language_model.*` beside a vision tower and MTP)."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith(("model.visual.", "mtp.", "model.mtp.")):
        return None
    return key


def config_is_decoder_only(raw: dict) -> bool:
    """Whether a read config.json describes only the text decoder (so a conversion may give it back
    as is): the `Qwen3_5ForCausalLM` form; the VLM's describes a vision tower too."""
    return "Qwen3_5ForCausalLM" in (raw.get("architectures") or [])
