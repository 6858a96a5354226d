"""Hugging Face `GlmMoeDsaForCausalLM` tensor names -> this project's GLM-5.x model (models/glm5.py),
full (unsharded) tensors: the table a model load and the conversion tool build on.

Per layer i (MTP layers, `model.layers.{num_layers}.*` and beyond, are skipped and counted):
  self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight, the two latent norms,
  self_attn.indexer.{wq_b, wk, weights_proj}.weight, indexer.k_norm.{weight, bias} (full layers)
      -> decoder.layers.i.self_attention.<same name>
  input_layernorm -> input_layernorm; post_attention_layernorm -> pre_mlp_layernorm
  dense mlp: [gate_proj; up_proj] -> mlp.linear_fc1, down_proj -> mlp.linear_fc2
  MoE: gate.weight -> mlp.router.weight, gate.e_score_correction_bias -> mlp.router.expert_bias,
       experts.gate_up_proj[e] -> mlp.experts.local_experts.e.linear_fc1 (gate rows then up rows, as
       Megatron's SwiGLU splits them), experts.down_proj[e] -> ...linear_fc2,
       shared_experts.[gate_proj; up_proj] -> mlp.shared_experts.linear_fc1, down_proj -> linear_fc2
"""

from __future__ import annotations

import re

import torch

_ATTN = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
         "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight",
         "indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.weights_proj.weight")


def hf_to_mcore(hf: dict, m) -> tuple[dict, list[str]]:
    """(model tensors by name, skipped HF names)."""
    out, skipped, used = {}, [], set()

    def take(name):
        used.add(name)
        return hf[name]

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    out["output_layer.weight"] = take("lm_head.weight")
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for n in _ATTN:
            if src + "self_attn." + n in hf:
                out[dst + "self_attention." + n] = take(src + "self_attn." + n)
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        if m.mlp_types[i] == "dense":
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([take(src + "mlp.gate_proj.weight"),
                                                            take(src + "mlp.up_proj.weight")])
            out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
            continue
        out[dst + "mlp.router.weight"] = take(src + "mlp.gate.weight")
        out[dst + "mlp.router.expert_bias"] = take(src + "mlp.gate.e_score_correction_bias").float()
        gu, dn = take(src + "mlp.experts.gate_up_proj"), take(src + "mlp.experts.down_proj")
        for e in range(m.n_routed_experts):
            out[dst + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gu[e]
            out[dst + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = dn[e]
        sh = src + "mlp.shared_experts."
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([take(sh + "gate_proj.weight"),
                                                                       take(sh + "up_proj.weight")])
        out[dst + "mlp.shared_experts.linear_fc2.weight"] = take(sh + "down_proj.weight")
    for name in hf:
        if name not in used:
            mtp = re.match(r"model\.layers\.(\d+)\.", name)
            if mtp and int(mtp.group(1)) >= m.num_layers:
                skipped.append(name)
            else:
                raise KeyError(f"{name}: not in the GLM-5.x mapping table")
    return out, skipped


def load_tp1(model, tensors: dict) -> None:
    """Copy full tensors into a TP=1, EP=1 model by name; every parameter and the router biases must be
    given, and nothing else."""
    own = dict(model.named_parameters())
    own.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise KeyError(f"GLM-5.x load: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for n, t in tensors.items():
            if tuple(own[n].shape) != tuple(t.shape):
                raise ValueError(f"{n}: checkpoint shape {tuple(t.shape)}, model {tuple(own[n].shape)}")
            own[n].copy_(t)
