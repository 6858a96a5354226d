"""MLA with DeepSeek Sparse Attention (GLM-5.x layers) on Megatron tensor parallel.

Shapes (package legend): T tokens of the call, B batch, h heads local to this TP rank, R kv_lora_rank,
Dn / Dr / Dv the no-RoPE / RoPE / value head dims, Hi / Di the indexer's heads and head dim, k top-k.

    q_resid = q_a_layernorm(q_a_proj(x));  [q_nope | q_pe] = q_b_proj(q_resid)     per head
    [c | k_pe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)                      shared by all heads
    q_pe, k_pe = interleaved RoPE at the tokens' positions
    "full" layer: top-k keys per query by the indexer (ops/dsa.py: ReLU scores of its own queries from
    q_resid and one normed key per token, weighted per head; deterministic tie-break); "shared"
    layer: the previous full layer's choice (IndexShare, `TopkShare`)
    o = attention of each head to its selected keys through the latent (W_UK, W_UV from kv_b_proj,
    absorbed: the per-head K/V are never expanded);  out = o_proj(o)

Tensor parallelism splits q_b_proj / kv_b_proj by heads and o_proj by rows; the latent, the RoPE
key and the indexer are computed whole on every TP rank (column-parallel with gathered output). The
selection gets no gradient (the indexer trains by its own loss in the reference, not by the policy
gradient).

Prompt state, through two hooks (prompt_state/hooks.py): the layer hands its tokens' latents (c,
k_pe, and on full layers the indexer key) to `ctx.latent` and gets back the latents its queries may
see; `ctx.attend_latent` computes the sparse attention over them. Where the state is whole on this
rank that is the single-rank twin of the hooks module; where it is sharded by sequence (context
parallelism, or the TP group's stripes: one latent serves every head) the contexts route it to
parallel/cp_dsa.py, which selects the global top-k and merges the attention across the ranks. The
mixer does not know which.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from longstraw_mcore.adapters.lora import effective_weight
from longstraw_mcore.config import GlmDsaConfig
from longstraw_mcore.models.norms import RMSNorm
from longstraw_mcore.ops.dsa import rope_interleaved
from longstraw_mcore.prompt_state.hooks import NO_STATE, LatentQuery, MLAKeys


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
                 model_cfg: GlmDsaConfig = None, share: TopkShare = None, kv=None, **kwargs):
        super().__init__(config=config)
        m = model_cfg
        assert m is not None and share is not None, "MLADSAMixer needs model_cfg and share (the spec passes them)"
        self.layer_number, self.share, self.m = layer_number, share, m
        self.tp_group = pg_collection.tp
        # `kv`: the TP group as one "KV group" at tp > 1 (one latent serves every head): the prompt state
        # is striped over it by sequence rather than replicated (prompt_state/mla.py)
        self.kv = kv
        self.query_block = 0  # memory.mla_query_block (memory/layers.py): queries per recomputed block
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

    def _rope(self, x, pos):
        """RoPE on the last dim of x [B, T, (h,) d] at positions `pos` (GLM-5.3-Flash's subclass has none)."""
        return rope_interleaved(x, pos, self.m.rope_theta)

    @torch.no_grad()
    def _index_key(self, x, pos):
        m, ix = self.m, self.indexer
        Dr = m.qk_rope_head_dim
        ki = ix.k_norm(ix.wk(x)[0])
        return torch.cat([self._rope(ki[..., :Dr], pos), ki[..., Dr:]], -1)

    @torch.no_grad()
    def _index_queries(self, x, q_resid, pos):
        """The indexer's queries [B, T, Hi, Di] (RoPE on their first dims) and per-head weights [B, T, Hi]."""
        m, ix = self.m, self.indexer
        B, T, _ = x.shape
        Dr = m.qk_rope_head_dim
        qi = ix.wq_b(q_resid)[0].view(B, T, m.index_n_heads, m.index_head_dim)
        qi = torch.cat([self._rope(qi[..., :Dr], pos), qi[..., Dr:]], -1)
        return qi, ix.weights_proj(x)[0] * m.index_n_heads ** -0.5

    def _own(self, x, pos) -> MLAKeys:
        """The latents of this call's tokens at positions `pos` (the state a later token needs)."""
        R = self.m.kv_lora_rank
        kv = self.kv_a_proj_with_mqa(x)[0]
        return MLAKeys(self.kv_a_layernorm(kv[..., :R]), self._rope(kv[..., R:], pos),
                       self._index_key(x, pos) if self.full else None, pos)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, **kwargs):
        """hidden_states [T, B, Hd] -> (out [T, B, Hd], None). The queries see what `ctx.latent` returns
        (the prompt's latents and their own), through `ctx.attend_latent`."""
        ctx, m = (inference_context if inference_context is not None else NO_STATE), self.m
        T, B, _ = hidden_states.shape
        x = hidden_states.transpose(0, 1)                                       # [B, T, Hd]
        pos = ctx.positions(T, x.device)
        Dn, Dr, Dv, R = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        own = self._own(x, pos)
        keys = ctx.latent(self.layer_number, own)
        q_resid = self.q_a_layernorm(self.q_a_proj(x)[0])
        q = self.q_b_proj(q_resid)[0].view(B, T, self.h, Dn + Dr)
        q_nope, q_pe = q.split([Dn, Dr], -1)
        q_pe = self._rope(q_pe, pos)
        if not self.full and self.share.selection is None:
            raise RuntimeError(f"layer {self.layer_number} shares the top-k of a previous full layer, but none ran")
        w = effective_weight(self.kv_b_proj).view(self.h, Dn + Dv, R)  # W (+ its adapter: adapters/lora.py)
        query = LatentQuery(q_nope, q_pe, w[:, :Dn], w[:, Dn:], pos, self.scale, m.index_topk, m.index_block,
                            index=self._index_queries(x, q_resid, pos) if self.full else None,
                            selection=None if self.full else self.share.selection, query_block=self.query_block,
                            pool=self._pool())
        o, selection = ctx.attend_latent(query, keys, own, self.tp_group, self.kv)
        if self.full:
            self.share.selection = selection
        out, _ = self.o_proj(o.reshape(B, T, self.h * Dv).transpose(0, 1).contiguous())
        return out, None

    def _pool(self):
        """A full layer's pooled-key parameters (ape, kpool) where its indexer scores pools of tokens (GLM-5.3-Flash),
        else None."""
        return None

    # memory.recompute=layer (memory/layers.py): what a call reads besides its arguments, handed to its
    # recompute: a shared layer's selection is the previous full layer's *at the forward*; by its
    # backward that layer (or a later one, or another micro-batch) may have set another
    def carried(self):
        return None if self.full else self.share.selection

    def restore(self, carried) -> None:
        if not self.full:
            self.share.selection = carried

    def produce_state(self, hidden_states, inference_context) -> None:
        """Only this layer's prompt state (its latents), handed to the context: exact mode's recompute
        of the model's last layer, whose output feeds nothing."""
        x = hidden_states.transpose(0, 1)
        inference_context.latent(self.layer_number, self._own(x, inference_context.positions(x.shape[1], x.device)))
