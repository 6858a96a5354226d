"""Hugging Face `GlmMoeDsaForCausalLM` tensor names -> the canonical (sharded-state-dict) keys of this
project's GLM-5.x model (models/glm5.py), full tensors: `checkpoint.full_state.load_full` puts each
rank's slices in place at any TP / EP.

Per layer i (MTP layers, `model.layers.{num_layers}.*` and beyond, are skipped and counted):
  self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight, the two latent norms,
  self_attn.indexer.{wq_b, wk, weights_proj}.weight, indexer.k_norm.{weight, bias} (full layers)
      -> decoder.layers.i.self_attention.<same name>
  input_layernorm -> input_layernorm; post_attention_layernorm -> pre_mlp_layernorm
  dense mlp: [gate_proj; up_proj] -> mlp.linear_fc1, down_proj -> mlp.linear_fc2
  MoE: gate.weight -> mlp.router.weight, gate.e_score_correction_bias -> mlp.router.expert_bias,
       experts.gate_up_proj [E, 2I, H] -> mlp.experts.experts.linear_fc1.weight (stacked on the expert
       axis as Megatron's SequentialMLP checkpoints them; gate rows then up rows, as its SwiGLU splits),
       experts.down_proj -> mlp.experts.experts.linear_fc2.weight,
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
        if name not in hf:
            from longstraw_mcore.checkpoint.common import CheckpointError

            raise CheckpointError(f"GLM-5.x checkpoint lacks tensor {name!r} (model.num_layers={m.num_layers}, "
                                  f"first_k_dense_replace={m.first_k_dense_replace})")
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
        # Megatron's SequentialMLP checkpoints its experts stacked on a leading expert axis: HF's layout
        gu, dn = take(src + "mlp.experts.gate_up_proj"), take(src + "mlp.experts.down_proj")
        for name, t in (("gate_up_proj", gu), ("down_proj", dn)):
            if t.shape[0] != m.n_routed_experts:
                from longstraw_mcore.checkpoint.common import CheckpointError

                raise CheckpointError(f"{src}mlp.experts.{name} holds {t.shape[0]} experts, model.n_routed_experts="
                                      f"{m.n_routed_experts}")
        out[dst + "mlp.experts.experts.linear_fc1.weight"] = gu
        out[dst + "mlp.experts.experts.linear_fc2.weight"] = dn
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
                from longstraw_mcore.checkpoint.common import CheckpointError

                raise CheckpointError(f"{name}: not in the GLM-5.x mapping table")
    return out, skipped
