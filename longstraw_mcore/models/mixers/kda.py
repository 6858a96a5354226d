"""Kimi Delta Attention token mixer (GLM-5.3-Flash's `linear_attention` layers) on Megatron tensor parallel.

Shapes (package legend): T tokens of the call, B batch, Hd hidden; h KDA heads *local to this TP rank* (as
many key heads as value heads), K = V their head dim, D = h K.

    q, k, v = {q,k,v}_proj(x);  q, k, v = silu(causal_conv([q, k, v]))     depthwise, kernel W, continuing
    f = f_b_proj(f_a_proj(x))  [B, T, h, K];  beta = sigmoid(b_proj(x))     the cached window
    g = bound sigmoid(e^{A_log} (f + dt_bias))  (or -e^{A_log} softplus(...) without a bound), per key channel
    o, S = kda(q, k, v, g, beta, S_in)          q/k L2-normalised, q scaled by K^-0.5 (ops/kda.py)
    out = o_proj(SigmoidGatedRMSNorm(o, g_b_proj(g_a_proj(x))))

Tensor parallelism splits by heads: q/k/v/b/f_b/g_b projections are column parallel, the three conv weights,
A_log and dt_bias are dim-0 slices (drawn in full and sliced: `full_then_shard`), o_proj is row parallel. The
low-rank first halves f_a_proj and g_a_proj (Hd -> K) are column parallel with a gathered output, so every
rank holds their whole output (their input gradient is summed over TP by the column-parallel second halves).
The output norm's weight [K] is shared by every head: its gradient is all-reduced over TP (models/norms.py).

The sequence core takes (q, k, v, f, b) head-major [B, T, h, ...] through the context's `recurrent` hook, as
Gated DeltaNet's does (prompt_state/hooks.py): its state (conv window of the q|k|v channels, recurrent state
[B, h, K, V]) is Gated DeltaNet's with one key head per value head, and both context-parallel paths (heads,
pieces) apply: KDA's step is affine in the entering state (ops/gdn_pieces.py, `rule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from longstraw_mcore.models.mixers.common import full_then_shard, sharded_state_dict_with_tp_params
from longstraw_mcore.models.norms import SigmoidGatedRMSNorm
from longstraw_mcore.ops.dispatch import conv_kernel, kda_kernel
from longstraw_mcore.ops.gdn_pieces import piece_maps
from longstraw_mcore.ops.kda import kda_gate
from longstraw_mcore.prompt_state.hooks import NO_STATE, GDNState


@dataclass
class KDASubmodules:
    in_proj: type = ColumnParallelLinear
    out_proj: type = RowParallelLinear


class KDAMixer(MegatronModule):
    _TP_PARAMS = {"A_log": 0, "dt_bias": 0, "conv_q": 0, "conv_k": 0, "conv_v": 0}

    def __init__(self, config, submodules: KDASubmodules, layer_number: int, pg_collection=None, model_cfg=None,
                 **kwargs):
        super().__init__(config=config)
        m = model_cfg
        if m is None:
            raise ValueError("KDAMixer needs model_cfg (the spec builder passes it)")
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp
        tp, r = self.tp_group.size(), self.tp_group.rank()
        if m.linear_num_heads % tp:
            raise ValueError(f"model.linear_num_heads={m.linear_num_heads} is not divisible by tp={tp}")
        self.h, self.dk = m.linear_num_heads // tp, m.linear_head_dim
        self.conv_width, self.chunk_size, self.state_dtype = m.linear_conv_kernel_dim, m.gdn_chunk_size, m.state_dtype
        self.lower_bound = m.linear_lower_bound
        Hd, D, K, W = config.hidden_size, m.linear_num_heads * m.linear_head_dim, m.linear_head_dim, self.conv_width

        def col(n_in, n_out, gather=False):
            return submodules.in_proj(n_in, n_out, config=config, init_method=config.init_method, bias=False,
                                      gather_output=gather, skip_bias_add=True, tp_group=self.tp_group)

        self.q_proj, self.k_proj, self.v_proj = col(Hd, D), col(Hd, D), col(Hd, D)
        self.f_a_proj, self.f_b_proj = col(Hd, K, True), col(K, D)
        self.b_proj = col(Hd, m.linear_num_heads)
        self.g_a_proj, self.g_b_proj = col(Hd, K, True), col(K, D)
        seed, tag = torch.initial_seed(), f"layer{layer_number}"
        std, dtype = config.init_method_std, config.params_dtype
        shard = partial(full_then_shard, tp_rank=r, tp_size=tp, dtype=dtype, seed=seed)

        def normal(t, g):
            return t.normal_(0.0, std, generator=g)

        self.conv_q = shard((D, W), normal, tag=tag + "cq")
        self.conv_k = shard((D, W), normal, tag=tag + "ck")
        self.conv_v = shard((D, W), normal, tag=tag + "cv")
        self.A_log = shard((m.linear_num_heads,), lambda t, g: t.uniform_(1.0, 16.0, generator=g).log_(), tag=tag + "A")
        self.dt_bias = shard((D,), lambda t, g: t.fill_(1.0), tag=tag + "dt")
        self.o_norm = SigmoidGatedRMSNorm(K, eps=m.rms_norm_eps, tp_group=self.tp_group, dtype=dtype)
        self.o_proj = submodules.out_proj(D, Hd, config=config, init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)

    def _core(self, q, k, v, f, b, heads: tuple[int, int], state: GDNState | None, window=None):
        """Conv + KDA of heads [h0, h1) (of this TP rank's) from `state` to the returned one. q, k, v, f
        [B, T, h, K] (q/k/v pre-conv, f the gate's projection before A_log and dt_bias), b [B, T, h]. State
        conv window [B, 3 (h1 - h0) K, W-1] (channels q | k | v). Returns (o [B, T, h, V] in the state dtype,
        new state); with `window` (a piece of a sequence under sequence-parallel CP, parallel/cp_gdn.py) its
        ops/gdn_pieces.PieceMaps and None."""
        h0, h1 = heads
        B, T = q.shape[:2]
        K, n = self.dk, (h1 - h0) * self.dk
        mixed = torch.cat([q.reshape(B, T, n), k.reshape(B, T, n), v.reshape(B, T, n)], dim=-1)
        conv_w = torch.cat([c[h0 * K:h1 * K] for c in (self.conv_q, self.conv_k, self.conv_v)], dim=0)
        piece = window is not None
        if not piece:
            window = state.conv if state is not None else None
        mixed, conv_state = conv_kernel(mixed).causal_conv1d(mixed, conv_w, window, activation="silu")
        q, k, v = (x.reshape(B, T, h1 - h0, K) for x in torch.split(mixed, [n, n, n], dim=-1))
        sd = self.state_dtype
        g = kda_gate(f.reshape(B, T, n), self.A_log[h0:h1], self.dt_bias[h0 * K:h1 * K], self.lower_bound).to(sd)
        beta = torch.sigmoid(b.to(sd))
        rule = kda_kernel(v, K, self.lower_bound).chunk_kda  # (fla on CUDA: its bounded-gate path where bounded)
        if piece:
            return piece_maps(q, k, v, g, beta, chunk_size=self.chunk_size, state_dtype=sd, rule=rule), None
        o, rec = rule(q, k, v, g, beta, state.recurrent if state is not None else None, chunk_size=self.chunk_size,
                      state_dtype=sd)
        return o, GDNState(conv=conv_state, recurrent=rec)

    def _mix(self, hidden_states, ctx):
        """Token-local projections, then the sequence core through the context (state; under context
        parallelism the head / sequence exchange). Returns o [B, T, h, V]."""
        T, B, _ = hidden_states.shape

        def heads(x, width):
            return x.transpose(0, 1).reshape(B, T, self.h, width) if width else x.transpose(0, 1)

        q, k, v = (heads(p(hidden_states)[0], self.dk) for p in (self.q_proj, self.k_proj, self.v_proj))
        f = heads(self.f_b_proj(self.f_a_proj(hidden_states)[0])[0], self.dk)
        b = heads(self.b_proj(hidden_states)[0], 0)
        return ctx.recurrent(self.layer_number, self._core, (q, k, v, f, b), self.h, self.conv_width)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, **kwargs):
        """hidden_states [T, B, Hd] -> (out [T, B, Hd], None), through the context's state (`NO_STATE`
        without one: the core starts from no state)."""
        T, B, _ = hidden_states.shape
        o = self._mix(hidden_states, inference_context if inference_context is not None else NO_STATE)
        gate = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0].transpose(0, 1).reshape(B, T, self.h, self.dk)
        o = self.o_norm(o.to(hidden_states.dtype), gate).reshape(B, T, self.h * self.dk)
        out, _ = self.o_proj(o.transpose(0, 1).contiguous())
        return out, None

    def produce_state(self, hidden_states, inference_context) -> None:
        """Only the state after the call (exact mode's recompute of the model's last layer)."""
        self._mix(hidden_states, inference_context)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return sharded_state_dict_with_tp_params(self, self._TP_PARAMS, prefix, sharded_offsets, metadata,
                                                 self.tp_group)
