"""Gated full attention (Qwen3.5/3.6 `full_attention` layers) on Megatron tensor parallel.

Shapes (package legend): T tokens of the call, B batch, P cached positions, D head_dim; Hq / Hk heads
local to this TP rank.

    [q | gate] = linear_q(x)            per head: D query dims then D gate dims (the reference layout)
    q = q_norm(q), k = k_norm(linear_k(x)), v = linear_v(x)      zero-centred RMSNorm over D
    q, k = partial RoPE at positions P..P+S-1 (first rotary_dim dims rotated, rest passed)
    o = softmax(q [K_cache, k]^T / sqrt(D), causal) [V_cache, v]      GQA: Hq/Hk queries per kv head
    out = linear_proj(o * sigmoid(gate))

Tensor parallel splits by heads (q heads with their gates, kv heads), `linear_proj` is row parallel.
With more TP ranks than KV heads, the ranks sharing a KV head (a KV group) each compute it in full
(`KVGroupLinear`) and shard its prompt state by sequence (parallel/kv_group.py).
The cached state is K (after k-norm and RoPE) and V of earlier positions: the mixer hands the K/V of
its own positions to the context (`ctx.key_sets`) and attends to the key sets it gets back, through
the one attention entry point (`ops.attention.attention`). Without a context (a plain forward) it
asks `NO_STATE`, the stateless single-rank hooks (prompt_state/hooks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from longstraw_mcore.models.mixers.common import sharded_state_dict_with_tp_params
from longstraw_mcore.models.norms import ZeroCenteredRMSNorm
from longstraw_mcore.ops.rope import apply_partial_rope, rope_cos_sin
from longstraw_mcore.prompt_state.hooks import NO_STATE


@dataclass
class GatedAttentionSubmodules:
    linear_qkv: type = ColumnParallelLinear
    linear_proj: type = RowParallelLinear


class GatedAttentionMixer(MegatronModule):
    def __init__(self, config, submodules: GatedAttentionSubmodules, layer_number: int, pg_collection=None,
                 model_cfg=None, kv=None, **kwargs):
        super().__init__(config=config)
        m = model_cfg
        assert m is not None, "GatedAttentionMixer needs model_cfg (the spec builder passes it)"
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        # tp > KV heads: this rank's KV head is shared with its KV group (parallel/kv_group.py)
        self.kv = kv
        self.hq, self.d = m.num_attention_heads // tp, m.head_dim
        self.hk = 1 if self.kv is not None else m.num_key_value_heads // tp
        self.rotary_dim, self.rope_theta = m.rotary_dim, m.rope_theta
        self.block = m.attention_block
        Hd = config.hidden_size

        def col(out_features):
            return submodules.linear_qkv(Hd, out_features, config=config, init_method=config.init_method, bias=False,
                                         gather_output=False, skip_bias_add=True, tp_group=self.tp_group)

        self.linear_q = col(m.num_attention_heads * m.head_dim * 2)
        if self.kv is None:
            self.linear_k = col(m.num_key_value_heads * m.head_dim)
            self.linear_v = col(m.num_key_value_heads * m.head_dim)
        else:
            from longstraw_mcore.parallel.kv_group import KVGroupLinear

            def kvlin(tag):
                return KVGroupLinear(Hd, m.head_dim, m.num_key_value_heads, self.kv, self.tp_group,
                                     config.params_dtype, config.init_method_std, torch.initial_seed(),
                                     f"layer{layer_number}{tag}")

            self.linear_k, self.linear_v = kvlin("k"), kvlin("v")
        self.q_norm = ZeroCenteredRMSNorm(config, m.head_dim, eps=m.rms_norm_eps, tp_group=self.tp_group)
        self.k_norm = ZeroCenteredRMSNorm(config, m.head_dim, eps=m.rms_norm_eps, tp_group=self.tp_group,
                                          replicas=self.kv.size if self.kv is not None else 1)
        self.linear_proj = submodules.linear_proj(m.num_attention_heads * m.head_dim, Hd, config=config,
                                                  init_method=config.output_layer_init_method, bias=False,
                                                  input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)

    def _own_kv(self, x: torch.Tensor, pos: torch.Tensor):
        """K (after k-norm and RoPE) and V of this call's tokens at positions `pos`, and the RoPE angles.
        x [B, T, Hd]."""
        B, T, _ = x.shape
        k, _ = self.linear_k(x)
        v, _ = self.linear_v(x)
        k = self.k_norm(k.reshape(B, T, self.hk, self.d))
        v = v.reshape(B, T, self.hk, self.d)
        cos, sin = rope_cos_sin(pos, self.rotary_dim, self.rope_theta, x.dtype)
        return apply_partial_rope(k, cos, sin), v, cos, sin

    def forward(self, hidden_states, attention_mask=None, inference_context=None, **kwargs):
        """hidden_states [T, B, Hd] -> (out [T, B, Hd], None). Asks the context for its key sets."""
        ctx = inference_context if inference_context is not None else NO_STATE
        T, B, _ = hidden_states.shape
        x = hidden_states.transpose(0, 1)                                       # [B, T, Hd]
        k, v, cos, sin = self._own_kv(x, ctx.positions(T, x.device))
        # The context turns this call's K/V into the key sets to attend to (and keeps what it must):
        # the cached positions read in place and these positions, one softmax over their union.
        keys = ctx.key_sets(self.layer_number, k, v)
        qg, _ = self.linear_q(x)
        qg = qg.reshape(B, T, self.hq, 2 * self.d)
        q, gate = qg[..., :self.d], qg[..., self.d:]
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        o, _ = ctx.attend(q, keys, ctx.position_offset, self.block, self.kv)
        o = o.reshape(B, T, self.hq * self.d) * torch.sigmoid(gate.reshape(B, T, self.hq * self.d))
        out, _ = self.linear_proj(o.transpose(0, 1).contiguous())
        return out, None

    def produce_state(self, hidden_states, inference_context) -> None:
        """Only what the prompt state needs from this layer (its K/V), handed to the context: exact
        mode's recompute of the model's last layer, whose output feeds nothing."""
        x = hidden_states.transpose(0, 1)
        k, v, _, _ = self._own_kv(x, inference_context.positions(x.shape[1], x.device))
        inference_context.key_sets(self.layer_number, k, v)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return sharded_state_dict_with_tp_params(self, {}, prefix, sharded_offsets, metadata, self.tp_group)
