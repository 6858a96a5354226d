"""The Qwen3.5/3.6 hybrid decoder on Megatron-Core: TransformerConfig, layer and block specs, build.

One spec builder for the family: each layer is Megatron's `TransformerLayer` with
  input_layernorm = ZeroCenteredRMSNorm, self_attention = GatedDeltaNetMixer | GatedAttentionMixer
  (by `full_attention_interval`), pre_mlp_layernorm = ZeroCenteredRMSNorm, mlp = Megatron SwiGLU MLP.
The model around the block is models/language_model.py's (embedding, final norm, untied output
layer). No Megatron class is forked. Cached prompt state reaches the mixers through Megatron's
`inference_context` argument (prompt_state/hooks.py); nothing else in the model knows about branch
replay.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longstraw_mcore import cpu_compat
from longstraw_mcore.config import ParallelConfig, Qwen35Config
from longstraw_mcore.models import language_model
from longstraw_mcore.models.language_model import ReplayLanguageModel, built_layout, pipeline_kwargs, stage_range
from longstraw_mcore.models.mixers.gated_attention import GatedAttentionMixer, GatedAttentionSubmodules
from longstraw_mcore.models.mixers.gated_deltanet import GatedDeltaNetMixer, GatedDeltaNetSubmodules
from longstraw_mcore.models.norms import ZeroCenteredRMSNorm


def transformer_config(m: Qwen35Config, p: ParallelConfig, device: str) -> TransformerConfig:
    """Megatron TransformerConfig for the family; CPU conventions come from cpu_compat."""
    dtype = m.torch_dtype
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_key_value_heads, kv_channels=m.head_dim,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        normalization="RMSNorm", layernorm_epsilon=m.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
        sequence_parallel=False, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        init_method_std=0.02,
        # Mixed layer types: checkpoint keys per global layer (decoder.layers.{i}.*), never stacked.
        hetereogenous_dist_checkpoint=True,
    )
    kwargs.update(pipeline_kwargs(m.num_layers, p))
    if device == "cpu":
        kwargs.update(cpu_compat.cpu_config_overrides())
    return TransformerConfig(**kwargs)


def layer_spec(layer_type: str, m: Qwen35Config, kv=None) -> ModuleSpec:
    """`kv`: this rank's KV group when tp exceeds the KV heads (parallel/kv_group.py), for attention."""
    if layer_type == "full_attention":
        mixer = ModuleSpec(module=GatedAttentionMixer, submodules=GatedAttentionSubmodules(),
                           params={"model_cfg": m, "kv": kv})
    elif layer_type == "linear_attention":
        mixer = ModuleSpec(module=GatedDeltaNetMixer, submodules=GatedDeltaNetSubmodules(), params={"model_cfg": m})
    else:
        raise ValueError(f"layer type {layer_type!r}: expected 'full_attention' or 'linear_attention'")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ZeroCenteredRMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=ZeroCenteredRMSNorm,
            mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                       linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(m: Qwen35Config, layers: range, kv=None) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (`layers`: their global indices), plus the final norm."""
    return TransformerBlockSubmodules(layer_specs=[layer_spec(m.layer_types[i], m, kv) for i in layers],
                                      layer_norm=ZeroCenteredRMSNorm)


def build_model(model_cfg: Qwen35Config, parallel, device: str, layer_kinds: dict,
                head: str = "lm", vp_stage: int | None = None) -> ReplayLanguageModel:
    """This rank's part of the model (its pipeline stage, its TP shard) on `device`; `layer_kinds`: the
    family's per-layer-type records (families/qwen3_5.py hands them in)."""
    pc = built_layout(parallel)
    spec = block_spec(model_cfg, stage_range(parallel, vp_stage), parallel.tp_kv)
    return language_model.build(transformer_config(model_cfg, pc, device), model_cfg, parallel, spec, layer_kinds,
                                device, head, vp_stage)
