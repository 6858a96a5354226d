"""The GLM-5.x decoder (`GlmMoeDsaForCausalLM`) on Megatron-Core: spec builder, TransformerConfig, model.

Each layer is Megatron's `TransformerLayer` with input_layernorm = RMSNorm, self_attention =
`MLADSAMixer` (below), pre_mlp_layernorm = RMSNorm, mlp = Megatron's SwiGLU `MLP` on the first
`first_k_dense_replace` layers and Megatron's `MoELayer` configured as GLM's router on the rest
(models/glm_moe.py). Embedding, final norm and the untied output layer as in the hybrid family's
model class, which this one reuses with its own layers.

MLA with DeepSeek Sparse Attention, per layer (legend: S tokens, B batch, H heads local to this TP
rank, R kv_lora_rank, Dn / Dr / Dv the no-RoPE / RoPE / value head dims):

    q_resid = q_a_layernorm(q_a_proj(x));  [q_nope | q_pe] = q_b_proj(q_resid)     per head
    [c | k_pe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)                      shared by all heads
    q_pe, k_pe = interleaved RoPE at the tokens' positions
    "full" layer: top-k keys per query by the indexer (ops/dsa.py: ReLU scores of its own queries from
    q_resid and one normed key per token, weighted per head; deterministic tie-break); "shared"
    layer: the previous full layer's choice (IndexShare)
    o = attention of each head to its selected keys through the latent (W_UK, W_UV from kv_b_proj,
    absorbed: the per-head K/V are never expanded);  out = o_proj(o)

Tensor parallelism splits q_b_proj / kv_b_proj by heads and o_proj by rows; the latent, the RoPE
key and the indexer are computed whole on every TP rank (column-parallel with gathered output), and
their gradients are summed over the TP ranks' heads. The selection gets no gradient (the indexer
trains by its own loss in the reference, not by the policy gradient).

Branch replay: under a prompt-state context the layer hands its tokens' latents (c, k_pe, and on
full layers the indexer key) to `ctx.latent` and attends to what it returns (prompt_state/mla.py).
Pipeline parallelism: every stage starts with a full indexer layer (GlmDsaConfig.check_layout), so
IndexShare never crosses a stage boundary (a shared layer's top-k comes from a full layer on its own
stage). Context parallelism: the prompt state sharded by sequence, the top-k merged globally and the
attention by log-sum-exp (parallel/cp_dsa.py). Not yet: the latent sharded by sequence inside the TP
group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from longstraw_mcore import cpu_compat
from longstraw_mcore.config import GlmDsaConfig
from longstraw_mcore.models.glm_moe import moe_config_kwargs, sequence_sharded_moe_spec
from longstraw_mcore.models.norms import RMSNorm
from longstraw_mcore.models.qwen3_5 import Qwen35HybridModel, pipeline_kwargs
from longstraw_mcore.ops.dsa import indexer_topk, mla_sparse, rope_interleaved
from longstraw_mcore.prompt_state.mla import MLAKeys


def transformer_config(m: GlmDsaConfig, p, device: str) -> TransformerConfig:
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


class TopkShare:
    """IndexShare within one forward: the last full layer's selection, read by the shared layers after it."""

    def __init__(self):
        self.selection = None


def _col(config, tp_group, n_in, n_out, gather):
    return ColumnParallelLinear(n_in, n_out, config=config, init_method=config.init_method, bias=False,
                                gather_output=gather, skip_bias_add=True, tp_group=tp_group)


class _Indexer(MegatronModule):
    """The DSA indexer's weights (a MegatronModule so its tensor-parallel linears checkpoint as such)."""

    def __init__(self, config, m: GlmDsaConfig, col):
        super().__init__(config=config)
        self.wq_b = col(m.q_lora_rank, m.index_n_heads * m.index_head_dim, True)
        self.wk = col(config.hidden_size, m.index_head_dim, True)
        self.k_norm = torch.nn.LayerNorm(m.index_head_dim, eps=1e-6, dtype=config.params_dtype)
        self.weights_proj = col(config.hidden_size, m.index_n_heads, True)


@dataclass
class MLADSASubmodules:
    pass


class MLADSAMixer(MegatronModule):
    def __init__(self, config, submodules: MLADSASubmodules, layer_number: int, pg_collection=None,
                 model_cfg: GlmDsaConfig = None, share: TopkShare = None, **kwargs):
        super().__init__(config=config)
        m = model_cfg
        assert m is not None and share is not None, "MLADSAMixer needs model_cfg and share (the spec passes them)"
        self.layer_number, self.share, self.m = layer_number, share, m
        self.tp_group = pg_collection.tp
        # the TP group as one "KV group" (setup_parallel makes it for this family at tp > 1): the prompt
        # state is striped over it by sequence rather than replicated (prompt_state/mla.py)
        self.kv = getattr(pg_collection, "tp_kv", None)
        tp = self.tp_group.size()
        if m.num_attention_heads % tp:
            raise ValueError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by tp={tp}")
        self.h = m.num_attention_heads // tp
        self.full = m.indexer_types[layer_number - 1] == "full"
        Hd, R = config.hidden_size, m.kv_lora_rank
        col = partial(_col, config, self.tp_group)
        self.q_a_proj = col(Hd, m.q_lora_rank, True)
        # the latent norms take a fixed eps of 1e-6 in the reference (not config.rms_norm_eps)
        self.q_a_layernorm = RMSNorm(config, m.q_lora_rank, eps=1e-6)
        self.q_b_proj = col(m.q_lora_rank, m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), False)
        self.kv_a_proj_with_mqa = col(Hd, R + m.qk_rope_head_dim, True)
        self.kv_a_layernorm = RMSNorm(config, R, eps=1e-6)
        self.kv_b_proj = col(R, m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim), False)
        self.o_proj = RowParallelLinear(m.num_attention_heads * m.v_head_dim, Hd, config=config,
                                        init_method=config.output_layer_init_method, bias=False,
                                        input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)
        if self.full:
            self.indexer = _Indexer(config, m, col)
        self.scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5

    @torch.no_grad()
    def _index_key(self, x, pos):
        m, ix = self.m, self.indexer
        Dr = m.qk_rope_head_dim
        ki = ix.k_norm(ix.wk(x)[0])
        return torch.cat([rope_interleaved(ki[..., :Dr], pos, m.rope_theta), ki[..., Dr:]], -1)

    @torch.no_grad()
    def _index_queries(self, x, q_resid, pos):
        """The indexer's queries (RoPE on their first dims) and per-head weights for tokens at `pos`."""
        m, ix = self.m, self.indexer
        B, S, _ = x.shape
        Dr = m.qk_rope_head_dim
        qi = ix.wq_b(q_resid)[0].view(B, S, m.index_n_heads, m.index_head_dim)
        qi = torch.cat([rope_interleaved(qi[..., :Dr], pos, m.rope_theta), qi[..., Dr:]], -1)
        return qi, ix.weights_proj(x)[0] * m.index_n_heads ** -0.5

    @torch.no_grad()
    def _select(self, x, q_resid, pos, keys: MLAKeys):
        """Top-k of `keys` for every query (queries at `pos`; keys at `keys.pos`)."""
        qi, w = self._index_queries(x, q_resid, pos)
        rows, vals = indexer_topk(qi, keys.ik, w, pos, keys.pos, self.m.index_topk, self.m.index_block)
        return rows, vals > float("-inf")

    def _own(self, x, pos) -> MLAKeys:
        """The latents of this call's tokens at positions `pos` (the state a later token needs)."""
        R = self.m.kv_lora_rank
        kv = self.kv_a_proj_with_mqa(x)[0]
        return MLAKeys(self.kv_a_layernorm(kv[..., :R]), rope_interleaved(kv[..., R:], pos, self.m.rope_theta),
                       self._index_key(x, pos) if self.full else None, pos)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, **kwargs):
        """hidden_states [S, B, Hd] -> (out [S, B, Hd], None). Under a prompt-state context the queries
        see what `ctx.latent` returns (the prompt's latents and their own)."""
        ctx, m = inference_context, self.m
        S, B, _ = hidden_states.shape
        x = hidden_states.transpose(0, 1)                                       # [B, S, Hd]
        pos = ctx.positions(S, x.device) if ctx is not None else torch.arange(S, device=x.device)
        Dn, Dr, Dv, R = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        own = self._own(x, pos)
        keys = ctx.latent(self.layer_number, own) if ctx is not None else own
        layout = getattr(ctx, "layout", None)
        if ctx is not None and (layout is not None or self.kv is not None):
            return self._forward_sharded(x, pos, own, keys, ctx, layout)
        q_resid = self.q_a_layernorm(self.q_a_proj(x)[0])
        q = self.q_b_proj(q_resid)[0].view(B, S, self.h, Dn + Dr)
        q_nope, q_pe = q.split([Dn, Dr], -1)
        q_pe = rope_interleaved(q_pe, pos, m.rope_theta)
        if self.full:
            self.share.selection = self._select(x, q_resid, pos, keys)
        elif self.share.selection is None:
            raise RuntimeError(f"layer {self.layer_number} shares the top-k of a previous full layer, but none ran")
        idx, valid = self.share.selection
        # the latent and RoPE key serve this rank's heads and the other ranks': gradients sum over TP
        c = copy_to_tensor_model_parallel_region(keys.c, group=self.tp_group)
        k_pe = copy_to_tensor_model_parallel_region(keys.pe, group=self.tp_group)
        w = self.kv_b_proj.weight.view(self.h, Dn + Dv, R)
        o = mla_sparse(q_nope, q_pe, c, k_pe, w[:, :Dn], w[:, Dn:], idx, valid, self.scale)
        out, _ = self.o_proj(o.reshape(B, S, self.h * Dv).transpose(0, 1).contiguous())
        return out, None

    def _forward_sharded(self, x, pos, own: MLAKeys, keys: MLAKeys, ctx, layout):
        """The prompt state sharded by sequence over the TP group (`self.kv`) and/or the CP ranks
        (`layout`): this rank holds its keys (parallel/cp_dsa.py). Queries: a chunk's are this CP rank's
        zig-zag rows, gathered to the whole chunk; a branch's are whole on every CP rank; inside the TP
        group every rank takes every head's queries and keeps its heads' output."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as copy_to

        from longstraw_mcore.parallel.cp_comm import gather_tokens
        from longstraw_mcore.parallel.cp_dsa import (GatherHeads, GatherTokens, LocalHeads, LocalRows, cp_select,
                                                     sharded_mla_sparse)

        m, kv = self.m, self.kv
        B, S, _ = x.shape
        Dn, Dr, Dv, R = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        rows = layout is not None and hasattr(ctx, "T")  # a chunk split over CP ranks
        levels = [g for g in (kv, layout) if g is not None]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)[0])
        q = self.q_b_proj(q_resid)[0].view(B, S, self.h, Dn + Dr)
        q_nope, q_pe = q.split([Dn, Dr], -1)
        q_pe = rope_interleaved(q_pe, pos, m.rope_theta)
        w = self.kv_b_proj.weight.view(self.h, Dn + Dv, R)
        w_uk, w_uv = w[:, :Dn], w[:, Dn:]
        q_pos = pos
        if rows:
            q_nope, q_pe = GatherTokens.apply(q_nope, layout, ctx.T), GatherTokens.apply(q_pe, layout, ctx.T)
            q_pos = ctx.span[0] + torch.arange(ctx.T, device=x.device)
        elif layout is not None:  # replicated queries and W_UK in a per-rank partial: gradients sum over CP
            q_nope, q_pe, w_uk = (copy_to(t, group=layout.group) for t in (q_nope, q_pe, w_uk))
        if kv is not None:  # every head's queries against this TP rank's stripe of the keys
            q_nope, q_pe = GatherHeads.apply(q_nope, kv), GatherHeads.apply(q_pe, kv)
            w_uk = GatherHeads.apply(w_uk[None, None], kv)[0, 0]
        if self.full:
            with torch.no_grad():
                qi, wi = self._index_queries(x, q_resid, pos)
                if rows:
                    qi, wi = gather_tokens(qi, layout, ctx.T), gather_tokens(wi, layout, ctx.T)
                kr, vals = indexer_topk(qi, keys.ik, wi, q_pos, keys.pos, m.index_topk, m.index_block, keys.counted)
                sel = keys.pos[kr]
                for g in levels:
                    sel, vals = cp_select(vals, sel, m.index_topk, g)
                self.share.selection = (sel, vals > float("-inf"))
        elif self.share.selection is None:
            raise RuntimeError(f"layer {self.layer_number} shares the top-k of a previous full layer, but none ran")
        sel, valid = self.share.selection
        c, k_pe = keys.c, keys.pe
        if kv is not None and torch.is_grad_enabled():
            # the call's own latents are computed on every TP rank: their gradient sums over the group
            # (the state rows are each rank's own stripe: theirs stays local)
            n = own.c.shape[1]
            c = torch.cat([c[:, :-n], copy_to(c[:, -n:], group=self.tp_group)], 1)
            k_pe = torch.cat([k_pe[:, :-n], copy_to(k_pe[:, -n:], group=self.tp_group)], 1)
        o_lat = sharded_mla_sparse(q_nope, q_pe, c, k_pe, keys.pos, keys.counted, w_uk, sel, valid, self.scale, levels)
        if kv is not None:
            o_lat = LocalHeads.apply(o_lat, kv)
        if rows:
            o_lat = LocalRows.apply(o_lat, layout, ctx.T)
        o = torch.einsum("bshr,hvr->bshv", o_lat, w_uv)
        out, _ = self.o_proj(o.reshape(B, S, self.h * Dv).transpose(0, 1).contiguous())
        return out, None

    def produce_state(self, hidden_states, inference_context) -> None:
        """Only this layer's prompt state (its latents), handed to the context: exact mode's recompute
        of the model's last layer, whose output feeds nothing."""
        x = hidden_states.transpose(0, 1)
        inference_context.latent(self.layer_number, self._own(x, inference_context.positions(x.shape[1], x.device)))


def layer_spec(i: int, m: GlmDsaConfig, share: TopkShare) -> ModuleSpec:
    mixer = ModuleSpec(module=MLADSAMixer, submodules=MLADSASubmodules(), params={"model_cfg": m, "share": share})
    if m.mlp_types[i] == "dense":
        mlp = partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                     linear_fc2=RowParallelLinear))
    else:
        mlp = sequence_sharded_moe_spec(m.n_routed_experts)
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=RMSNorm, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=RMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def block_spec(m: GlmDsaConfig, pp_rank: int, stages: list[int]) -> TransformerBlockSubmodules:
    first = sum(stages[:pp_rank])
    share = TopkShare()  # one per model: the stage's layers pass the selection down
    return TransformerBlockSubmodules(layer_specs=[layer_spec(i, m, share) for i in range(first, first + stages[pp_rank])],
                                      layer_norm=RMSNorm)


class GlmDsaModel(Qwen35HybridModel):
    """Embedding -> MLA/DSA + dense/MoE layers -> final RMSNorm + untied output layer (vocab-parallel
    logits `[B, S, V_pad/tp]`)."""

    block_spec_fn = staticmethod(block_spec)


def build_model(model_cfg: GlmDsaConfig, parallel, device: str) -> GlmDsaModel:
    from longstraw_mcore.config import ParallelConfig as PC
    from longstraw_mcore.models.glm_moe import float64_routing

    if model_cfg.torch_dtype == torch.float64:
        float64_routing()  # float64 validation runs route in float64 (models/glm_moe.py)

    pc = PC(tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, ep=getattr(parallel, "ep", 1),
            pp_layers=getattr(parallel, "stage_layers", None))
    model_cfg.check_layout(pc)  # before anything is allocated
    model = GlmDsaModel(transformer_config(model_cfg, pc, device), model_cfg, parallel.pgs,
                        pre_process=parallel.is_first_stage, post_process=parallel.is_last_stage)
    return model.cuda() if device == "cuda" else model
