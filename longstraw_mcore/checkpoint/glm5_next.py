"""Hugging Face `Glm5NextForConditionalGeneration` (GLM-5.3-Flash, transformers' `glm5_next`) <-> the canonical
(sharded-state-dict) keys of this project's GLM-5.3-Flash text decoder: its `config.json` (read and written; the
decoder is its `text_config`), and one mapping table for both directions (checkpoint/rule_table.py; round trip
bit-exact). Names are the ones `save_pretrained` writes (transformers' conversion_mapping.py `glm5_next` renames
them when it loads); `from_transformers_state` turns an in-memory state dict into them.

Per layer i, `L` = model.language_model.layers.i., `G` = decoder.layers.i.:
  L input_layernorm.weight -> G input_layernorm.weight; L post_attention_layernorm.weight -> G pre_mlp_layernorm.weight
  L hc_attn_{fn, base, scale} -> G input_layernorm.hc.{fn, base, scale}   ([(N+2)N, N H], [(N+2)N], [3]; N = hc_mult)
  L hc_ffn_{fn, base, scale} -> G pre_mlp_layernorm.hc.{fn, base, scale}   (in memory: attn_hc.*, ffn_hc.*)
  KDA layers (D = linear_num_heads x linear_head_dim; in memory the forget gate's four sit under forget_gate.):
    self_attn.{q, k, v}_proj.weight -> G self_attention.<same>
    self_attn.{q, k, v}_conv1d.weight [D, 1, W] -> G self_attention.conv_{q, k, v} [D, W]   (split_conv, one piece;
        in memory one conv1d.weight [3D, 1, W])
    self_attn.{f_a_proj.weight, f_b_proj.weight, A_log, dt_bias, b_proj.weight, g_a_proj.weight, g_b_proj.weight,
        o_norm.weight, o_proj.weight} -> G self_attention.<same>
  MLA layers: GLM-5.2's names (checkpoint/glm_dsa.py; kv_a_proj_with_mqa has kv_lora_rank rows: no RoPE part),
    full layers also self_attn.indexer.index_kpool_compress_{ape, gate} -> G self_attention.indexer.kpool_{ape, gate}
  MLP: GLM-5.2's rules, shared with checkpoint/glm_dsa.py (dense [gate; up] -> mlp.linear_fc1; MoE router, its
    correction bias, per-expert gate/up/down stacked on the expert axis, shared experts)
  model.language_model.{embed_tokens, norm}.weight, lm_head.weight -> embedding.word_embeddings.weight,
    decoder.final_layernorm.weight, output_layer.weight

Not the decoder's, counted and dropped on load (`skipped_names`); the vision tower kept for export
(`passthrough_names`): model.visual.*
(blocks.{b}.attn.{qkv, proj}.{weight, bias}, blocks.{b}.attn.{q, k}_norm.weight, blocks.{b}.mlp.{gate, up,
down}_proj.{weight, bias}, blocks.{b}.norm{1, 2}.weight, patch_embed.proj.{weight, bias}, post_layernorm.weight,
downsample.{weight, bias}, merger.{proj, gate_proj, up_proj, down_proj}.weight, merger.post_projection_norm.{weight,
bias}), and multi-token prediction (model.language_model.layers.{n >= num_layers}.*, any *.shared_head.*).

Every tensor keeps its dtype both ways. transformers keeps `_keep_in_fp32_modules_strict` in float32 when it loads
in bf16, and saves them so: hc_{attn, ffn}_{base, scale}, self_attn.{A_log, dt_bias, q/k/v_conv1d.weight} and
mlp.gate.e_score_correction_bias (not hc_*_fn); the model casts on load.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from longstraw_mcore.checkpoint import glm_dsa, rule_table
from longstraw_mcore.checkpoint.common import CheckpointError, config_dtype, read_config_json
from longstraw_mcore.checkpoint.rule_table import Rule
from longstraw_mcore.config import ConfigError, Glm5NextConfig, GlmDsaConfig

ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
HEADS = {"token_value": ("Glm5NextForTokenClassification",),
         "sequence_score": ("Glm5NextForSequenceClassification",)}
"""A critic's and a reward model's architectures under GLM's names (transformers has none: checkpoint/heads.py)."""
LM = "model.language_model."
"""Where the text decoder's tensors sit in the VLM's checkpoint."""
_REQUIRED = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
             "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
             "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_DEFAULTS = {"num_key_value_heads": 64, "qk_rope_head_dim": 0, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
             "swiglu_limit": 10.0, "index_kpool": 16, "linear_head_dim": 128, "linear_num_heads": 64,
             "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6,
             "hc_sinkhorn_iters": 20, "rms_norm_eps": 1e-5}
"""transformers 5.23's `Glm5NextTextConfig` defaults of the optional fields read here (a config.json may omit them)."""
_SUPPORTED = {"tie_word_embeddings": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
              "attention_bias": False, "hidden_act": "silu", "qk_rope_head_dim": 0,
              "index_kpool_always_select_tail": True}
_KDA = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias",
        "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight")
_HC = (("attn", "input_layernorm"), ("ffn", "pre_mlp_layernorm"))


def _mlp_rules_and_shapes(m) -> tuple[list[Rule], dict[str, tuple[int, ...]]]:
    """GLM-5.2's dense / MoE MLP rules and shapes (checkpoint/glm_dsa.py; they read only the MLP fields, which
    Glm5NextConfig names alike, and `mlp_types`), moved under this checkpoint's `model.language_model.` prefix."""
    def on_disk(name: str) -> str:
        return LM + name.removeprefix("model.")

    rules = [Rule(tuple(on_disk(n) for n in r.hf), r.mcore, r.transform, r.sizes)
             for r in glm_dsa.rules(m) if ".mlp." in r.mcore[0]]
    shapes = {on_disk(k): v for k, v in glm_dsa.hf_shapes(m).items() if ".mlp." in k}
    return rules, shapes


def rules(m: Glm5NextConfig) -> list[Rule]:
    D = m.linear_num_heads * m.linear_head_dim
    out = [
        Rule((LM + "embed_tokens.weight",), ("embedding.word_embeddings.weight",), "identity"),
        Rule((LM + "norm.weight",), ("decoder.final_layernorm.weight",), "identity"),
        Rule(("lm_head.weight",), ("output_layer.weight",), "identity"),
    ]
    for i, kind in enumerate(m.mixer_types):
        h, g = f"{LM}layers.{i}.", f"decoder.layers.{i}."
        a, s = h + "self_attn.", g + "self_attention."
        out += [Rule((h + "input_layernorm.weight",), (g + "input_layernorm.weight",), "identity"),
                Rule((h + "post_attention_layernorm.weight",), (g + "pre_mlp_layernorm.weight",), "identity")]
        out += [Rule((f"{h}hc_{x}_{p}",), (f"{g}{norm}.hc.{p}",), "identity")
                for x, norm in _HC for p in ("fn", "base", "scale")]
        if kind == "linear_attention":
            out += [Rule((a + n,), (s + n,), "identity") for n in _KDA]
            out += [Rule((f"{a}{x}_conv1d.weight",), (f"{s}conv_{x}",), "split_conv", (D,)) for x in "qkv"]
            continue
        out += [Rule((a + n,), (s + n,), "identity") for n in glm_dsa._ATTN]
        if m.indexer_types[i] == "full":
            out += [Rule((a + n,), (s + n,), "identity") for n in glm_dsa._INDEXER]
            out += [Rule((f"{a}indexer.index_kpool_compress_{x}",), (f"{s}indexer.kpool_{x}",), "identity")
                    for x in ("ape", "gate")]
    return out + _mlp_rules_and_shapes(m)[0]


def hf_shapes(m: Glm5NextConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every text-decoder tensor a `Glm5NextForConditionalGeneration` checkpoint of this config holds
    (the vision tower and MTP aside: `skipped_names`)."""
    H, V, N = m.hidden_size, m.vocab_size, m.hc_mult
    nh, Dn, Dv, R, Q = m.num_attention_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
    h_, K, W = m.linear_num_heads, m.linear_head_dim, m.linear_conv_kernel_dim
    D, Di, ni = h_ * K, m.index_head_dim, m.index_n_heads
    shapes = {LM + "embed_tokens.weight": (V, H), LM + "norm.weight": (H,), "lm_head.weight": (V, H)}
    for i, kind in enumerate(m.mixer_types):
        h = f"{LM}layers.{i}."
        a = h + "self_attn."
        shapes.update({h + "input_layernorm.weight": (H,), h + "post_attention_layernorm.weight": (H,)})
        for x, _ in _HC:
            shapes.update({f"{h}hc_{x}_fn": ((N + 2) * N, N * H), f"{h}hc_{x}_base": ((N + 2) * N,),
                           f"{h}hc_{x}_scale": (3,)})
        if kind == "linear_attention":
            shapes.update({a + "q_proj.weight": (D, H), a + "k_proj.weight": (D, H), a + "v_proj.weight": (D, H),
                           a + "q_conv1d.weight": (D, 1, W), a + "k_conv1d.weight": (D, 1, W),
                           a + "v_conv1d.weight": (D, 1, W), a + "f_a_proj.weight": (K, H),
                           a + "f_b_proj.weight": (D, K), a + "A_log": (h_,), a + "dt_bias": (D,),
                           a + "b_proj.weight": (h_, H), a + "g_a_proj.weight": (K, H), a + "g_b_proj.weight": (D, K),
                           a + "o_norm.weight": (K,), a + "o_proj.weight": (H, D)})
            continue
        shapes.update({a + "q_a_proj.weight": (Q, H), a + "q_a_layernorm.weight": (Q,),
                       a + "q_b_proj.weight": (nh * Dn, Q), a + "kv_a_proj_with_mqa.weight": (R, H),
                       a + "kv_a_layernorm.weight": (R,), a + "kv_b_proj.weight": (nh * (Dn + Dv), R),
                       a + "o_proj.weight": (H, nh * Dv)})
        if m.indexer_types[i] == "full":
            shapes.update({a + "indexer.wq_b.weight": (ni * Di, Q), a + "indexer.wk.weight": (Di, H),
                           a + "indexer.k_norm.weight": (Di,), a + "indexer.k_norm.bias": (Di,),
                           a + "indexer.weights_proj.weight": (ni, H),
                           a + "indexer.index_kpool_compress_ape": (m.index_kpool, Di),
                           a + "indexer.index_kpool_compress_gate": (Di, H)})
    shapes.update(_mlp_rules_and_shapes(m)[1])
    return shapes


def check_hf_tensors(tensors: Mapping, m: Glm5NextConfig, where: str = "checkpoint") -> None:
    rule_table.check_hf_tensors(tensors, hf_shapes(m), where)


def skipped_names(names, m: Glm5NextConfig) -> list[str]:
    """The stored names that are not the text decoder's, dropped and counted: the vision tower (`model.visual.*`,
    listed in the module docstring) and the multi-token-prediction layers (`model.language_model.layers.{n}.*` for
    n >= num_layers, and any `shared_head`)."""
    out = []
    for name in names:
        hit = re.match(r"model\.language_model\.layers\.(\d+)\.", name)
        if (name.startswith("model.visual.") or ".shared_head." in name
                or (hit is not None and int(hit.group(1)) >= m.num_layers)):
            out.append(name)
    return out


def passthrough_names(names, m: Glm5NextConfig) -> list[str]:
    """The stored names that go back out unchanged on export (checkpoint/passthrough.py): the vision tower,
    `model.visual.*`, which the only transformers class (the VLM) needs and the recorded config.json describes. Not
    the MTP layers: transformers drops them on load (`_keys_to_ignore_on_load_unexpected`), and after training the
    decoder they would be stale (their `shared_head` copies of the head, their draft predictions made from the old
    decoder's states), so an export leaves them out (a serving engine then runs without the MTP draft)."""
    return [name for name in names if name.startswith("model.visual.")]


class LazyCanonical(rule_table.LazyCanonical):
    """Canonical tensors read on access (`read(key, slices)`: only a rank's shard, e.g. its experts)."""

    def __init__(self, hf: Mapping, m: Glm5NextConfig, where: str = "checkpoint"):
        super().__init__(hf, rules(m), hf_shapes(m), where)


def hf_to_mcore(hf: Mapping, m: Glm5NextConfig, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF tensors (on-disk names; see `from_transformers_state`) -> canonical Megatron tensors."""
    lazy = LazyCanonical(hf, m, where)
    return {k: lazy[k] for k in lazy}


def mcore_to_hf(mc: Mapping, m: Glm5NextConfig, only: Rule | None = None) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors -> HF tensors (every rule, or `only` one of them)."""
    return rule_table.to_hf(mc, [only] if only is not None else rules(m))


_IN_MEMORY = ((re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), r".hc_\1_\2"),
              (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."))


def from_transformers_state(state: Mapping) -> dict[str, torch.Tensor]:
    """A `transformers` glm5_next state dict (of `Glm5NextForConditionalGeneration`, `Glm5NextModel` or the text
    model `Glm5NextTextModel`) under the names its checkpoints store (views, no copies): prefixed as in the VLM,
    `attn_hc.fn` -> `hc_attn_fn` (and base, scale, ffn_hc), `self_attn.forget_gate.X` -> `self_attn.X`, the KDA
    `conv1d.weight` [3D, 1, W] split into `q_conv1d` / `k_conv1d` / `v_conv1d`, fused experts per expert."""
    keys = list(state)
    if any(k.startswith("model.") for k in keys):
        prefix = ""
    elif any(k.startswith("language_model.") for k in keys):
        prefix = "model."
    else:
        prefix = LM
    out = {}
    for name, t in state.items():
        name = prefix + name
        if name.startswith(LM):
            for pattern, repl in _IN_MEMORY:
                name = pattern.sub(repl, name)
            hit = re.fullmatch(r"(.*\.self_attn\.)conv1d\.weight", name)
            if hit is not None:
                for x, piece in zip("qkv", t.chunk(3, dim=0)):
                    out[f"{hit.group(1)}{x}_conv1d.weight"] = piece
                continue
        out[name] = t
    return glm_dsa.from_transformers_state(out)


# ---------------------------------------------------------------------------------------------
# config.json


def _layer_lists(text: dict, n: int, cfg_file: Path) -> tuple[list, list, list]:
    """(layer_types, indexer_types, mlp_layer_types) as transformers derives them (Glm5NextTextConfig.__post_init__),
    each checked for length and values."""
    mixers = text.get("layer_types")
    if mixers is None:
        mixers = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    mixers = ["indexed_attention" if t == "full_attention" else t for t in mixers]
    indexers = text.get("indexer_types")
    if indexers is None and text.get("index_topk_pattern") is not None:
        pat = text["index_topk_pattern"]
        if isinstance(pat, str) and set(pat) - {"F", "S"}:
            raise CheckpointError(f"{cfg_file}: index_topk_pattern={pat!r}; expected letters F (full) and S (shared)")
        indexers = [{"F": "full", "S": "shared"}[c] for c in pat] if isinstance(pat, str) else list(pat)
    if indexers is None:
        indexers = GlmDsaConfig.index_share_schedule(n, text.get("index_topk_freq", 1),
                                                     text.get("index_skip_topk_offset", 2))
    mlp = text.get("mlp_layer_types")
    if mlp is None:
        mlp = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    for key, v, allowed in (("layer_types", mixers, ("linear_attention", "indexed_attention")),
                            ("indexer_types", indexers, ("full", "shared")),
                            ("mlp_layer_types", mlp, ("dense", "sparse"))):
        if not isinstance(v, list) or len(v) != n or any(t not in allowed for t in v):
            raise CheckpointError(f"{cfg_file}: {key}={v!r}; need num_hidden_layers={n} entries, each one of "
                                  f"{list(allowed)}")
    return list(mixers), list(indexers), list(mlp)


def read_config(path: str | Path) -> tuple[Glm5NextConfig, dict]:
    """`config.json` of a `Glm5NextForConditionalGeneration` directory -> (Glm5NextConfig of its `text_config`, raw
    dict). A flat config (text fields at the top level, which transformers also reads) is accepted. Settings this
    family does not run are refused with the key and value named."""
    raw, cfg_file = read_config_json(path, ARCHITECTURES + sum(HEADS.values(), ()))
    text = raw.get("text_config")
    text = raw if text is None else text
    where = "text_config" if text is not raw else "config.json"
    missing = [k for k in _REQUIRED if k not in text]
    if missing:
        raise CheckpointError(f"{cfg_file}: {where} lacks required field(s) {missing}")
    if raw.get("tie_word_embeddings", False):
        raise CheckpointError(f"{cfg_file}: tie_word_embeddings={raw['tie_word_embeddings']!r}; GLM-5.3-Flash "
                              "here supports tie_word_embeddings=False")
    for key, want in _SUPPORTED.items():
        if text.get(key, want) != want:
            raise CheckpointError(f"{cfg_file}: {where} {key}={text[key]!r}; GLM-5.3-Flash here supports "
                                  f"{key}={want!r}")
    get = {**_DEFAULTS, **{k: v for k, v in text.items() if k in _DEFAULTS}}
    nh, kv = text["num_attention_heads"], get["num_key_value_heads"]
    kv = nh if kv is None else kv
    if kv != nh:
        raise CheckpointError(f"{cfg_file}: {where} num_key_value_heads={kv!r} differs from num_attention_heads={nh}; "
                              "MLA here has one key/value head per query head")
    if text["q_lora_rank"] is None:
        raise CheckpointError(f"{cfg_file}: {where} q_lora_rank=None; the DSA indexer needs a query LoRA rank")
    lin = text.get("linear_attn_config")
    if lin is not None:  # as transformers: the dict overrides the linear_* fields
        if not isinstance(lin, dict):
            raise CheckpointError(f"{cfg_file}: {where} linear_attn_config={lin!r} is not a mapping")
        for field, key in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                           ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                           ("linear_lower_bound", "gate_lower_bound")):
            get[field] = lin.get(key, get[field])
        if lin.get("safe_gate", True) and get["linear_lower_bound"] is None:
            get["linear_lower_bound"] = -5.0
    n = text["num_hidden_layers"]
    mixers, indexers, mlp = _layer_lists(text, n, cfg_file)
    dtype = config_dtype(cfg_file, text, raw)
    try:
        m = Glm5NextConfig(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
            num_layers=n, mixer_types=mixers, indexer_types=indexers, mlp_layer_types=mlp, num_attention_heads=nh,
            q_lora_rank=text["q_lora_rank"], kv_lora_rank=text["kv_lora_rank"],
            qk_nope_head_dim=text["qk_nope_head_dim"], qk_rope_head_dim=get["qk_rope_head_dim"],
            v_head_dim=text["v_head_dim"], index_n_heads=text["index_n_heads"], index_head_dim=text["index_head_dim"],
            index_topk=text["index_topk"], index_kpool=get["index_kpool"], n_routed_experts=text["n_routed_experts"],
            num_experts_per_tok=text["num_experts_per_tok"], n_shared_experts=get["n_shared_experts"],
            moe_intermediate_size=text["moe_intermediate_size"],
            routed_scaling_factor=float(get["routed_scaling_factor"]), swiglu_limit=float(get["swiglu_limit"]),
            linear_num_heads=get["linear_num_heads"], linear_head_dim=get["linear_head_dim"],
            linear_conv_kernel_dim=get["linear_conv_kernel_dim"],
            linear_lower_bound=None if get["linear_lower_bound"] is None else float(get["linear_lower_bound"]),
            hc_mult=get["hc_mult"], hc_eps=float(get["hc_eps"]), hc_sinkhorn_iters=get["hc_sinkhorn_iters"],
            rms_norm_eps=float(get["rms_norm_eps"]), dtype=dtype)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    return m, raw


def _text_config(m: Glm5NextConfig) -> dict:
    return {
        "model_type": "glm5_next_text", "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size, "moe_intermediate_size": m.moe_intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads, "n_shared_experts": m.n_shared_experts,
        "n_routed_experts": m.n_routed_experts, "routed_scaling_factor": m.routed_scaling_factor,
        "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank, "qk_rope_head_dim": 0,
        "v_head_dim": m.v_head_dim, "qk_nope_head_dim": m.qk_nope_head_dim, "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": m.num_experts_per_tok, "norm_topk_prob": True, "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": False, "attention_bias": False,
        "layer_types": list(m.mixer_types), "indexer_types": list(m.indexer_types),
        "mlp_layer_types": list(m.mlp_layer_types), "index_topk": m.index_topk, "index_head_dim": m.index_head_dim,
        "index_n_heads": m.index_n_heads, "index_kpool": m.index_kpool, "index_kpool_always_select_tail": True,
        "swiglu_limit": m.swiglu_limit, "linear_head_dim": m.linear_head_dim, "linear_num_heads": m.linear_num_heads,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim, "linear_lower_bound": m.linear_lower_bound,
        "hc_mult": m.hc_mult, "hc_eps": m.hc_eps, "hc_sinkhorn_iters": m.hc_sinkhorn_iters,
    }


def _set_dtype(section: dict, dtype: str) -> None:
    keys = [k for k in ("dtype", "torch_dtype") if k in section]
    for k in keys:
        section[k] = dtype


def hf_config_dict(m: Glm5NextConfig, raw: dict | None = None) -> dict:
    """A `Glm5NextForConditionalGeneration` config.json for this model. With `raw` (the recorded config.json):
    that config with its text decoder's fields replaced by this model's (its vision_config, image/video token ids
    and the text fields this project does not model, e.g. pad/eos ids and max_position_embeddings, kept;
    `linear_attn_config` dropped, the explicit linear_* fields say the same). Without: `text_config` only, which
    transformers reads with its default vision_config (GLM-5.3-Flash's) and token ids."""
    text = _text_config(m)
    if raw is None:
        return {"architectures": list(ARCHITECTURES), "model_type": "glm5_next", "text_config": text,
                "tie_word_embeddings": False, "dtype": m.dtype}
    out = copy.deepcopy(raw)
    if "text_config" in out:
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "linear_attn_config"} | text
        _set_dtype(out["text_config"], m.dtype)
    else:  # the flat form: the text fields at the top level
        out.pop("linear_attn_config", None)
        out.update({k: v for k, v in text.items() if k != "model_type"})
    _set_dtype(out, m.dtype)
    if not any(k in out for k in ("dtype", "torch_dtype")):
        out["dtype"] = m.dtype
    return out


def tensor_name(key: str) -> str:
    """A stored key under the name the table reads it by: the stored names themselves (the vision tower and MTP
    layers are set aside by `skipped_names`; the exporters pass the vision tensors through: `passthrough_names`)."""
    return key


def config_is_decoder_only(raw: dict) -> bool:
    """Whether the read config.json describes only the text decoder, so that a conversion writing the decoder's
    tensors alone may give it back as is: never here. The only form transformers has is the VLM, whose config
    names a vision tower (and image/video token ids) whose tensors the decoder table does not carry."""
    return False


# ---------------------------------------------------------------------------------------------
# adapter sites

_KDA_SITES = (("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("b_proj", "column"),
              ("forget_gate.f_a_proj", "gathered"), ("forget_gate.f_b_proj", "column"), ("g_a_proj", "gathered"),
              ("g_b_proj", "column"), ("o_proj", "row"))
"""KDA's projections as PEFT sees them (module paths under `self_attn.`, in transformers' in-memory tree: the forget
gate's two under `forget_gate.`) and their Megatron kind (models/mixers/kda.py: f_a / g_a gather their output)."""
_MLA_SITES = (("q_a_proj", "gathered"), ("q_b_proj", "column"), ("kv_a_proj_with_mqa", "gathered"),
              ("kv_b_proj", "column"), ("o_proj", "row"))


def adapter_sites(m: Glm5NextConfig) -> list:
    """Every projection an adapter may target (adapters/sites.py), by the module paths `peft` sees on
    `Glm5NextForConditionalGeneration` (`model.language_model.layers.{i}.self_attn.forget_gate.f_a_proj`, ...; none
    in the vision tower, `model.visual.*`, whose gate/up/down_proj a bare PEFT target name would also match), in
    layer order. KDA layers: q/k/v/b/f_a/f_b/g_a/g_b/o (`Site.weight` names the forget gate's stored weights, which
    checkpoints keep as `self_attn.f_a_proj.weight`); MLA layers: GLM-5.2's five (kv_b_proj's adapter acts on the
    absorbed weight); the dense MLP's, the shared expert's and each routed expert's gate/up/down as GLM-5.2's
    (checkpoint/glm_dsa.py: experts by their stored names `mlp.experts.{e}.gate_proj`, each its own adapter on the EP
    rank that holds it); lm_head. Shapes are each module's own (out, in), not `projection_shapes`' smallest."""
    from dataclasses import replace

    from longstraw_mcore.adapters.sites import Part, Site

    H, R, Q, nh = m.hidden_size, m.kv_lora_rank, m.q_lora_rank, m.num_attention_heads
    D, K = m.linear_num_heads * m.linear_head_dim, m.linear_head_dim
    kda = {"q_proj": (D, H), "k_proj": (D, H), "v_proj": (D, H), "b_proj": (m.linear_num_heads, H),
           "f_a_proj": (K, H), "f_b_proj": (D, K), "g_a_proj": (K, H), "g_b_proj": (D, K), "o_proj": (H, D)}
    mla = {"q_a_proj": (Q, H), "q_b_proj": (nh * m.qk_nope_head_dim, Q), "kv_a_proj_with_mqa": (R, H),
           "kv_b_proj": (nh * (m.qk_nope_head_dim + m.v_head_dim), R), "o_proj": (H, nh * m.v_head_dim)}
    mlp_sites: dict[int, list] = {}
    for s in glm_dsa.adapter_sites(m):  # GLM-5.2's MLP sites (they read the MLP fields and `mlp_types` only)
        if s.layer is not None and ".mlp." in s.name:
            mlp_sites.setdefault(s.layer, []).append(replace(s, name=LM + s.name.removeprefix("model.")))
    out = []
    for i, kind in enumerate(m.mixer_types):
        a, s = f"{LM}layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
        for path, k in (_KDA_SITES if kind == "linear_attention" else _MLA_SITES):
            target = path.rsplit(".", 1)[-1]
            shape = (kda if kind == "linear_attention" else mla)[target]
            weight = a + target + ".weight" if path != target else None
            out.append(Site(a + path, target, shape, k, (Part(s + target, (0, shape[0])),), i, weight=weight))
        out += mlp_sites.get(i, [])
    out.append(Site("lm_head", "lm_head", (m.vocab_size, H), "column", (Part("output_layer", (0, m.vocab_size)),),
                    None))
    return out
