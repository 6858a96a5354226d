"""The GLM-5.x decoder (`GlmMoeDsaForCausalLM`) on Megatron-Core: TransformerConfig, layer and block
specs, build.

Each layer is Megatron's `TransformerLayer` with input_layernorm = RMSNorm, self_attention =
`MLADSAMixer` (models/mixers/mla_dsa.py: MLA + DeepSeek Sparse Attention with IndexShare),
pre_mlp_layernorm = RMSNorm, mlp = Megatron's SwiGLU `MLP` on the first `first_k_dense_replace` layers
and Megatron's `MoELayer` configured as GLM's router on the rest (models/glm_moe.py). The model around
the block is models/language_model.py's (embedding, final norm, untied output layer).

Pipeline parallelism: every stage starts with a full indexer layer (GlmDsaConfig.check_layout), so
IndexShare never crosses a stage boundary (a shared layer's top-k comes from a full layer on its own
stage: one `TopkShare` per stage's block).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longstraw_mcore import cpu_compat
from longstraw_mcore.config import GlmDsaConfig, ParallelConfig
from longstraw_mcore.models import language_model
from longstraw_mcore.models.glm_moe import float64_routing, mlp_spec, moe_config_kwargs
from longstraw_mcore.models.language_model import ReplayLanguageModel, built_layout, pipeline_kwargs, stage_range
from longstraw_mcore.models.mixers.mla_dsa import MLADSAMixer, MLADSASubmodules, TopkShare
from longstraw_mcore.models.norms import RMSNorm


def transformer_config(m: GlmDsaConfig, p: ParallelConfig, device: str) -> TransformerConfig:
    dtype = m.torch_dtype
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.v_head_dim, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=m.rms_norm_eps,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=False, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        init_method_std=0.02, hetereogenous_dist_checkpoint=True,
        **moe_config_kwargs(m.n_routed_experts, m.num_experts_per_tok, m.moe_intermediate_size,
                            m.n_shared_experts, m.routed_scaling_factor,
                            router_dtype="fp64" if dtype == torch.float64 else "fp32"),
    )
    kwargs.update(pipeline_kwargs(m.num_layers, p))
    if device == "cpu":
        kwargs.update(cpu_compat.cpu_config_overrides())
    return TransformerConfig(**kwargs)


def layer_spec(i: int, m: GlmDsaConfig, share: TopkShare, kv=None) -> ModuleSpec:
    """Layer `i` (global); `kv`: the TP group as one KV group at tp > 1 (the latent striped over it)."""
    mixer = ModuleSpec(module=MLADSAMixer, submodules=MLADSASubmodules(),
                       params={"model_cfg": m, "share": share, "kv": kv})
    mlp = mlp_spec(m, i)
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def block_spec(m: GlmDsaConfig, layers: range, kv=None) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (`layers`: their global indices), plus the final norm."""
    share = TopkShare()  # one per stage: its layers pass the selection down
    return TransformerBlockSubmodules(layer_specs=[layer_spec(i, m, share, kv) for i in layers], layer_norm=RMSNorm)


def build_model(model_cfg: GlmDsaConfig, parallel, device: str, layer_kinds: dict,
                head: str = "lm", vp_stage: int | None = None) -> ReplayLanguageModel:
    """This rank's part of the model on `device`; `layer_kinds`: the family's per-layer-type records
    (families/glm_dsa.py hands them in)."""
    if model_cfg.torch_dtype == torch.float64:
        float64_routing()  # float64 validation runs route in float64 (models/glm_moe.py)
    pc = built_layout(parallel, with_ep=True)
    model_cfg.check_layout(pc)  # before anything is allocated
    spec = block_spec(model_cfg, stage_range(parallel, vp_stage), parallel.tp_kv)
    return language_model.build(transformer_config(model_cfg, pc, device), model_cfg, parallel, spec, layer_kinds,
                                device, head, vp_stage)
