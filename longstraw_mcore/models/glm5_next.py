"""The GLM-5.3-Flash text decoder (transformers' `glm5_next`) on Megatron-Core: TransformerConfig, layer and block
specs, build.

Each layer is Megatron's `TransformerLayer` with
  input_layernorm = HCNorm (the layer's attention hyper-connection + RMSNorm: models/hyper_connection.py),
  self_attention = KDAMixer (models/mixers/kda.py) or MLAKpoolMixer (models/mixers/mla_kpool.py) by mixer_types,
  self_attn_bda = hc_bda (the sublayer's output mixed back into the residual streams),
  pre_mlp_layernorm = HCNorm (the FFN's), mlp = Megatron's SwiGLU `MLP` (dense layers) or `MoELayer` as GLM's
  router (models/glm_moe.py), both with the SwiGLU clamp (`activation_func_clamp_value` = swiglu_limit),
  mlp_bda = hc_bda;
the block's final norm is HCHead (mean of the streams, RMSNorm). Between layers and pipeline stages the residual
is the hc_mult streams flattened, [T, B, hc_mult x Hd]; the model's embedding output is copied into them
(`ModelBase.residual_streams`, models/language_model.py). The model around the block is language_model.py's.

Pipeline parallelism: no stage starts at a "shared" MLA layer (Glm5NextConfig.check_layout), so a selection never
crosses a stage (one `TopkShare` per stage's block, as GLM-5.2).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longstraw_mcore import cpu_compat
from longstraw_mcore.config import Glm5NextConfig, ParallelConfig
from longstraw_mcore.models import language_model
from longstraw_mcore.models.glm_moe import float64_routing, mlp_spec, moe_config_kwargs
from longstraw_mcore.models.hyper_connection import HCHead, HCNorm, hc_bda
from longstraw_mcore.models.language_model import ReplayLanguageModel, built_layout, pipeline_kwargs, stage_range
from longstraw_mcore.models.mixers.kda import KDAMixer, KDASubmodules
from longstraw_mcore.models.mixers.mla_dsa import TopkShare
from longstraw_mcore.models.mixers.mla_kpool import MLADSASubmodules, MLAKpoolMixer


def transformer_config(m: Glm5NextConfig, p: ParallelConfig, device: str) -> TransformerConfig:
    dtype = m.torch_dtype
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.v_head_dim, gated_linear_unit=True,
        activation_func=F.silu, activation_func_clamp_value=m.swiglu_limit, add_bias_linear=False,
        normalization="RMSNorm", layernorm_epsilon=m.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=1, sequence_parallel=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, init_method_std=0.02,
        hetereogenous_dist_checkpoint=True,
        **moe_config_kwargs(m.n_routed_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.n_shared_experts,
                            m.routed_scaling_factor, router_dtype="fp64" if dtype == torch.float64 else "fp32"),
    )
    kwargs.update(pipeline_kwargs(m.num_layers, p))
    if device == "cpu":
        kwargs.update(cpu_compat.cpu_config_overrides())
    return TransformerConfig(**kwargs)


def layer_spec(i: int, m: Glm5NextConfig, share: TopkShare, kv=None) -> ModuleSpec:
    """Layer `i` (global); `kv`: the TP group as one KV group at tp > 1 (the MLA latent striped over it)."""
    if m.mixer_types[i] == "linear_attention":
        mixer = ModuleSpec(module=KDAMixer, submodules=KDASubmodules(), params={"model_cfg": m})
    else:
        mixer = ModuleSpec(module=MLAKpoolMixer, submodules=MLADSASubmodules(),
                           params={"model_cfg": m, "share": share, "kv": kv})
    mlp = mlp_spec(m, i)
    norm = partial(HCNorm, model_cfg=m)
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=mixer, self_attn_bda=hc_bda, pre_mlp_layernorm=norm, mlp=mlp,
        mlp_bda=hc_bda))


def block_spec(m: Glm5NextConfig, layers: range, kv=None) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (`layers`: their global indices), plus the final norm of the streams."""
    share = TopkShare()
    return TransformerBlockSubmodules(layer_specs=[layer_spec(i, m, share, kv) for i in layers],
                                      layer_norm=partial(HCHead, model_cfg=m))


def build_model(model_cfg: Glm5NextConfig, parallel, device: str, layer_kinds: dict,
                head: str = "lm", vp_stage: int | None = None) -> ReplayLanguageModel:
    """This rank's part of the model on `device`; `layer_kinds`: the family's per-layer-type records
    (families/glm5_next.py hands them in)."""
    if model_cfg.torch_dtype == torch.float64:
        float64_routing()
    pc = built_layout(parallel, with_ep=True)
    model_cfg.check_layout(pc)
    spec = block_spec(model_cfg, stage_range(parallel, vp_stage), parallel.tp_kv)
    model = language_model.build(transformer_config(model_cfg, pc, device), model_cfg, parallel, spec, layer_kinds,
                                 device, head, vp_stage)
    init_streams_and_pools(model)
    return model


def init_streams_and_pools(model) -> None:
    """transformers' initialisation of what Megatron does not initialise here: each hyper-connection's fn normal
    (std 0.02), base 0, scale 1; the pooled indexer's ape 0 and gate 1. fn is drawn in full from a generator keyed
    by (run seed, layer, sublayer), so every layout (and every TP replica) starts from the same weights."""
    from longstraw_mcore.models.mixers.common import full_then_shard

    seed = torch.initial_seed()
    with torch.no_grad():
        for layer in model.decoder.layers:
            for slot in ("input_layernorm", "pre_mlp_layernorm"):
                hc = getattr(layer, slot).hc
                fn = full_then_shard(tuple(hc.fn.shape), lambda t, g: t.normal_(0.0, 0.02, generator=g), 0, 1,
                                     hc.fn.dtype, seed, f"layer{layer.layer_number}{slot}", sharded=False)
                hc.fn.copy_(fn)
                hc.base.zero_()
                hc.scale.fill_(1.0)
            ix = getattr(layer.self_attention, "indexer", None)
            if ix is not None and hasattr(ix, "kpool_ape"):
                ix.kpool_ape.zero_()
                ix.kpool_gate.fill_(1.0)
