"""The GLM-5.x family (`GlmMoeDsaForCausalLM`, `glm_moe_dsa` in transformers): MLA + DeepSeek Sparse
Attention with IndexShare, dense then MoE layers. Spec builder in models/glm5.py, name table in
checkpoint/glm_dsa.py; full indexer layers keep the MLA latent and the indexer key per position,
shared ones the latent only (prompt_state/mla.py)."""

from __future__ import annotations

from longstraw_mcore.checkpoint import glm_dsa as mapping
from longstraw_mcore.families import Family
from longstraw_mcore.prompt_state.mla import MLAIndexerState, MLALatentState


def _build_model(model_cfg, parallel, device):
    from longstraw_mcore.models.glm5 import build_model

    return build_model(model_cfg, parallel, device)


def _read_hf_config(path):
    return mapping.read_config(path)


FAMILY = Family(
    name="glm_dsa",
    build_model=_build_model,
    read_hf_config=_read_hf_config,
    mapping=mapping,
    architectures=("GlmMoeDsaForCausalLM",),
    state_kinds={"mla_dsa_full": MLAIndexerState, "mla_dsa_shared": MLALatentState},
)


def glm_5_2(dtype: str = "bfloat16", **overrides):
    """GLM-5.2's real dimensions (zai-org's config.json as summarised in ../shared/notes/architectures.md
    section 3; transformers' GlmMoeDsaConfig for the IndexShare schedule): 78 layers, MLA (q LoRA 2048,
    kv LoRA 512, RoPE 64, no-RoPE 192, value 256, 64 heads), DSA (32 indexer heads of 128, top 2048,
    IndexShare every 4th layer after the first 3), MoE from layer 3 (256 experts, top 8, one shared)."""
    from longstraw_mcore.config import GlmDsaConfig

    base = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_layers=78, num_attention_heads=64,
                q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                index_n_heads=32, index_head_dim=128, index_topk=2048,
                index_topk_freq=4, index_skip_topk_offset=3, first_k_dense_replace=3,
                n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                routed_scaling_factor=2.5, rope_theta=8_000_000.0, rms_norm_eps=1e-5, dtype=dtype,
                make_vocab_size_divisible_by=128)
    base.update(overrides)
    return GlmDsaConfig(**base)
