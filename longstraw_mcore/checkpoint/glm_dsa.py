"""Hugging Face `GlmMoeDsaForCausalLM` <-> the canonical (sharded-state-dict) keys of this project's
GLM-5.x model (models/glm5.py): its `config.json` (read and written), and one mapping table for both directions
(checkpoint/rule_table.py; round trip bit-exact). Full tensors: `checkpoint.full_state.load_full`
puts each rank's slices in place at any TP / EP, reading only those slices from safetensors.

Per layer i (MTP layers, `model.layers.{num_layers}.*` and beyond, are skipped and counted):
  self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight, the two latent norms,
  self_attn.indexer.{wq_b, wk, weights_proj}.weight, indexer.k_norm.{weight, bias} (full layers)
      -> decoder.layers.i.self_attention.<same name>
  input_layernorm -> input_layernorm; post_attention_layernorm -> pre_mlp_layernorm
  dense mlp: [gate_proj; up_proj] -> mlp.linear_fc1, down_proj -> mlp.linear_fc2
  MoE: gate.weight -> mlp.router.weight, gate.e_score_correction_bias -> mlp.router.expert_bias,
       experts.{e}.[gate_proj; up_proj] -> mlp.experts.experts.linear_fc1.weight [E, 2I, H] (stacked on
       the expert axis as Megatron's SequentialMLP checkpoints them; gate rows then up rows, as its
       SwiGLU splits), experts.{e}.down_proj -> mlp.experts.experts.linear_fc2.weight [E, H, I],
       shared_experts.[gate_proj; up_proj] -> mlp.shared_experts.linear_fc1, down_proj -> linear_fc2

Experts are named per expert, as the published checkpoints store them (`transformers` fuses them into
`experts.gate_up_proj` / `experts.down_proj` when it loads; `from_transformers_state` turns such an
in-memory state dict back into per-expert views). Every tensor keeps its dtype both ways (the router
bias is float32 in the published bf16 checkpoints; the model casts on load).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from longstraw_mcore.adapters.sites import Part, Site
from longstraw_mcore.checkpoint import rule_table
from longstraw_mcore.checkpoint.common import CheckpointError, config_dtype, read_config_json
from longstraw_mcore.checkpoint.rule_table import Rule
from longstraw_mcore.config import ConfigError, GlmDsaConfig

ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
HEADS = {"token_value": ("GlmMoeDsaForTokenClassification",), "sequence_score": ("GlmMoeDsaForSequenceClassification",)}
"""A critic's and a reward model's architectures under GLM's names (transformers has none: checkpoint/heads.py)."""
_REQUIRED = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
             "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_ATTN = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
         "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")
_INDEXER = ("indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
            "indexer.weights_proj.weight")


def rules(m) -> list[Rule]:
    F, I = m.intermediate_size, m.moe_intermediate_size
    out = [
        Rule(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), "identity"),
        Rule(("model.norm.weight",), ("decoder.final_layernorm.weight",), "identity"),
        Rule(("lm_head.weight",), ("output_layer.weight",), "identity"),
    ]
    for i in range(m.num_layers):
        h, g = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = _ATTN + (_INDEXER if m.indexer_types[i] == "full" else ())
        out += [Rule((h + "self_attn." + n,), (g + "self_attention." + n,), "identity") for n in attn]
        out += [Rule((h + "input_layernorm.weight",), (g + "input_layernorm.weight",), "identity"),
                Rule((h + "post_attention_layernorm.weight",), (g + "pre_mlp_layernorm.weight",), "identity")]
        if m.mlp_types[i] == "dense":
            out += [Rule((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), (g + "mlp.linear_fc1.weight",),
                         "concat_rows", (F, F)),
                    Rule((h + "mlp.down_proj.weight",), (g + "mlp.linear_fc2.weight",), "identity")]
            continue
        e, s = h + "mlp.experts.", h + "mlp.shared_experts."
        Is = I * m.n_shared_experts
        out += [
            Rule((h + "mlp.gate.weight",), (g + "mlp.router.weight",), "identity"),
            Rule((h + "mlp.gate.e_score_correction_bias",), (g + "mlp.router.expert_bias",), "identity"),
            Rule(tuple(f"{e}{j}.{p}_proj.weight" for j in range(m.n_routed_experts) for p in ("gate", "up")),
                 (g + "mlp.experts.experts.linear_fc1.weight",), "stack_concat", (I, I)),
            Rule(tuple(f"{e}{j}.down_proj.weight" for j in range(m.n_routed_experts)),
                 (g + "mlp.experts.experts.linear_fc2.weight",), "stack_concat", (m.hidden_size,)),
        ]
        if m.n_shared_experts:
            out += [Rule((s + "gate_proj.weight", s + "up_proj.weight"), (g + "mlp.shared_experts.linear_fc1.weight",),
                         "concat_rows", (Is, Is)),
                    Rule((s + "down_proj.weight",), (g + "mlp.shared_experts.linear_fc2.weight",), "identity")]
    return out


def adapter_sites(m) -> list[Site]:
    """Every projection an adapter may target (adapters/sites.py). Routed experts by their stored names
    (`mlp.experts.{e}.gate_proj`), each its own adapter on the EP rank that holds the expert."""
    shapes = m.projection_shapes()
    H, I = m.hidden_size, m.moe_intermediate_size
    out = []
    for i in range(m.num_layers):
        h, g = f"model.layers.{i}.", f"decoder.layers.{i}."
        for x, kind in (("q_a_proj", "gathered"), ("q_b_proj", "column"), ("kv_a_proj_with_mqa", "gathered"),
                        ("kv_b_proj", "column"), ("o_proj", "row")):
            out.append(Site(h + "self_attn." + x, x, shapes[x], kind, (Part(g + "self_attention." + x, (0, shapes[x][0])),), i))

        def mlp(hf, mc, inner, kind, expert=None):
            return [Site(hf + "gate_proj", "gate_proj", (inner, H), kind, (Part(mc + "linear_fc1", (0, inner), 0, (inner, inner)),), i, expert),
                    Site(hf + "up_proj", "up_proj", (inner, H), kind, (Part(mc + "linear_fc1", (0, inner), 1, (inner, inner)),), i, expert),
                    Site(hf + "down_proj", "down_proj", (H, inner), "row" if kind == "column" else kind,
                         (Part(mc + "linear_fc2", (0, H)),), i, expert)]

        if m.mlp_types[i] == "dense":
            out += mlp(h + "mlp.", g + "mlp.", m.intermediate_size, "column")
            continue
        if m.n_shared_experts:
            out += mlp(h + "mlp.shared_experts.", g + "mlp.shared_experts.", I * m.n_shared_experts, "column")
        for e in range(m.n_routed_experts):
            out += mlp(f"{h}mlp.experts.{e}.", f"{g}mlp.experts.local_experts.{e}.", I, "expert", e)
    out.append(Site("lm_head", "lm_head", shapes["lm_head"], "column", (Part("output_layer", (0, m.vocab_size)),), None))
    return out


def hf_shapes(m) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a `GlmMoeDsaForCausalLM` checkpoint of this config holds (MTP aside)."""
    H, V, F, I, E = m.hidden_size, m.vocab_size, m.intermediate_size, m.moe_intermediate_size, m.n_routed_experts
    nh, Dn, Dr, Dv, R, Q = (m.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                            m.kv_lora_rank, m.q_lora_rank)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(m.num_layers):
        h = f"model.layers.{i}."
        a = h + "self_attn."
        shapes.update({h + "input_layernorm.weight": (H,), h + "post_attention_layernorm.weight": (H,),
                       a + "q_a_proj.weight": (Q, H), a + "q_a_layernorm.weight": (Q,),
                       a + "q_b_proj.weight": (nh * (Dn + Dr), Q), a + "kv_a_proj_with_mqa.weight": (R + Dr, H),
                       a + "kv_a_layernorm.weight": (R,), a + "kv_b_proj.weight": (nh * (Dn + Dv), R),
                       a + "o_proj.weight": (H, nh * Dv)})
        if m.indexer_types[i] == "full":
            Di, ni = m.index_head_dim, m.index_n_heads
            shapes.update({a + "indexer.wq_b.weight": (ni * Di, Q), a + "indexer.wk.weight": (Di, H),
                           a + "indexer.k_norm.weight": (Di,), a + "indexer.k_norm.bias": (Di,),
                           a + "indexer.weights_proj.weight": (ni, H)})
        if m.mlp_types[i] == "dense":
            shapes.update({h + "mlp.gate_proj.weight": (F, H), h + "mlp.up_proj.weight": (F, H),
                           h + "mlp.down_proj.weight": (H, F)})
            continue
        shapes.update({h + "mlp.gate.weight": (E, H), h + "mlp.gate.e_score_correction_bias": (E,)})
        for j in range(E):
            e = f"{h}mlp.experts.{j}."
            shapes.update({e + "gate_proj.weight": (I, H), e + "up_proj.weight": (I, H), e + "down_proj.weight": (H, I)})
        if m.n_shared_experts:
            s, Is = h + "mlp.shared_experts.", I * m.n_shared_experts
            shapes.update({s + "gate_proj.weight": (Is, H), s + "up_proj.weight": (Is, H), s + "down_proj.weight": (H, Is)})
    return shapes


def check_hf_tensors(tensors: Mapping, m, where: str = "checkpoint") -> None:
    rule_table.check_hf_tensors(tensors, hf_shapes(m), where)


def skipped_names(names, m) -> list[str]:
    """The multi-token-prediction layers (`model.layers.{n}.*` for n >= num_layers): not part of the
    decoder a policy-gradient step trains; dropped and counted."""
    out = []
    for name in names:
        hit = re.match(r"model\.layers\.(\d+)\.", name)
        if hit and int(hit.group(1)) >= m.num_layers:
            out.append(name)
    return out


class LazyCanonical(rule_table.LazyCanonical):
    """Canonical tensors read on access (`read(key, slices)`: only a rank's shard, e.g. its experts)."""

    def __init__(self, hf: Mapping, m, where: str = "checkpoint"):
        super().__init__(hf, rules(m), hf_shapes(m), where)


def hf_to_mcore(hf: Mapping, m, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF tensors (per-expert names; see `from_transformers_state`) -> canonical Megatron tensors."""
    lazy = LazyCanonical(hf, m, where)
    return {k: lazy[k] for k in lazy}


def mcore_to_hf(mc: Mapping, m, only: Rule | None = None) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors -> HF tensors (every rule, or `only` one of them)."""
    return rule_table.to_hf(mc, [only] if only is not None else rules(m))


def from_transformers_state(state: Mapping) -> dict[str, torch.Tensor]:
    """A `transformers` model's state dict (experts fused: `experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) under the per-expert names the checkpoints use (views, no copies)."""
    out = {}
    for name, t in state.items():
        hit = re.fullmatch(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)", name)
        if hit is None:
            out[name] = t
            continue
        for j, w in enumerate(t.unbind(0)):
            if hit.group(2) == "down_proj":
                out[f"{hit.group(1)}{j}.down_proj.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{hit.group(1)}{j}.gate_proj.weight"] = gate
                out[f"{hit.group(1)}{j}.up_proj.weight"] = up
    return out


# ---------------------------------------------------------------------------------------------
# config.json


def read_config(path: str | Path) -> tuple[GlmDsaConfig, dict]:
    """`config.json` of a `GlmMoeDsaForCausalLM` directory -> (GlmDsaConfig, raw dict)."""
    raw, cfg_file = read_config_json(path, ARCHITECTURES + sum(HEADS.values(), ()))
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise CheckpointError(f"{cfg_file}: lacks required field(s) {missing}")
    n = raw["num_hidden_layers"]
    for key, want in (("tie_word_embeddings", False), ("n_group", 1), ("topk_group", 1), ("norm_topk_prob", True),
                      ("attention_bias", False), ("hidden_act", "silu"), ("indexer_rope_interleave", True)):
        if raw.get(key, want) != want:
            raise CheckpointError(f"{cfg_file}: {key}={raw[key]!r}; the GLM-5.x family here supports {key}={want!r}")
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pat = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pat] if isinstance(pat, str) else list(pat)
    if types is None:
        types = GlmDsaConfig.index_share_schedule(n, raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2))
    first_dense = raw.get("first_k_dense_replace", 0)
    mlp = raw.get("mlp_layer_types")
    if mlp is not None:
        first_dense = sum(1 for t in mlp if t == "dense")
        if mlp != ["dense"] * first_dense + ["sparse"] * (n - first_dense):
            raise CheckpointError(f"{cfg_file}: mlp_layer_types {mlp} is not dense layers followed by MoE layers")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{cfg_file}: rope_type {rope['rope_type']!r}; only the default RoPE is supported")
    dtype = config_dtype(cfg_file, raw)
    try:
        m = GlmDsaConfig(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_layers=n, num_attention_heads=raw["num_attention_heads"], q_lora_rank=raw["q_lora_rank"],
            kv_lora_rank=raw["kv_lora_rank"], qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"], v_head_dim=raw["v_head_dim"], index_n_heads=raw["index_n_heads"],
            index_head_dim=raw["index_head_dim"], index_topk=raw["index_topk"], indexer_types=list(types),
            index_topk_freq=raw.get("index_topk_freq", 1), index_skip_topk_offset=raw.get("index_skip_topk_offset", 2),
            first_k_dense_replace=first_dense, n_routed_experts=raw["n_routed_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"], n_shared_experts=raw.get("n_shared_experts", 1),
            moe_intermediate_size=raw["moe_intermediate_size"],
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), dtype=dtype)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    return m, raw


def hf_config_dict(m: GlmDsaConfig) -> dict:
    """A `GlmMoeDsaForCausalLM` config.json for this model (transformers reads `indexer_types` as is)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "index_n_heads": m.index_n_heads, "index_head_dim": m.index_head_dim, "index_topk": m.index_topk,
        "indexer_types": list(m.indexer_types), "first_k_dense_replace": m.first_k_dense_replace,
        "n_routed_experts": m.n_routed_experts, "num_experts_per_tok": m.num_experts_per_tok,
        "n_shared_experts": m.n_shared_experts, "moe_intermediate_size": m.moe_intermediate_size,
        "routed_scaling_factor": m.routed_scaling_factor, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}, "num_nextn_predict_layers": 0,
        "dtype": m.dtype,
    }


def tensor_name(key: str) -> str:
    """A stored key under the name the table reads it by: the published checkpoints use
    `GlmMoeDsaForCausalLM`'s own names (its MTP layer is set aside by `skipped_names`)."""
    return key


def config_is_decoder_only(raw: dict) -> bool:
    """A `GlmMoeDsaForCausalLM` config.json describes the decoder (with its MTP layer): given back as is."""
    return True
