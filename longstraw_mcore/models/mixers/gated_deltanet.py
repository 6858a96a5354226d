"""Gated DeltaNet token mixer (Qwen3.5/3.6 `linear_attention` layers) on Megatron tensor parallel.

Shapes (package legend): T tokens of the call, B batch, Hd hidden; hk key heads and Hv value heads
*local to this TP rank*.

    q, k, v = in_proj_{q,k,v}(x);  z = in_proj_z(x);  b = in_proj_b(x);  a = in_proj_a(x)
    q, k, v = silu(causal_conv([q, k, v]))             depthwise, kernel W, continuing the cached window
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)       (state dtype, >= float32)
    o, S = gated_delta_rule(q, k, v, g, beta, S_in)    q/k L2-normalised, q scaled by Dk^-0.5
    out = out_proj(GatedRMSNorm(o, z))

Tensor parallel splits by head group: rank r owns q/k heads [r*hk, (r+1)*hk) and the value heads
they serve, so every projection, conv channel, A_log and dt_bias is a contiguous dim-0 slice, and
out_proj is row parallel. The reference fuses q/k/v into one `in_proj_qkv` (and one conv over the
concatenated channels); a per-rank head slice of that fused tensor is not contiguous, so here they
are three column-parallel projections (and three conv weights), joined/split by a named transform
in checkpoint/qwen3_5.py. The depthwise conv is per channel, so the split is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from longstraw_mcore.models.mixers.common import full_then_shard, sharded_state_dict_with_tp_params
from longstraw_mcore.models.norms import GatedRMSNorm
from longstraw_mcore.ops.dispatch import conv_kernel, gdn_kernel
from longstraw_mcore.ops.gdn_pieces import piece_maps
from longstraw_mcore.prompt_state.hooks import NO_STATE, GDNState


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: type = ColumnParallelLinear
    out_proj: type = RowParallelLinear


class GatedDeltaNetMixer(MegatronModule):
    _TP_PARAMS = {"A_log": 0, "dt_bias": 0, "conv_q": 0, "conv_k": 0, "conv_v": 0}

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int, pg_collection=None,
                 model_cfg=None, **kwargs):
        super().__init__(config=config)
        m = model_cfg
        assert m is not None, "GatedDeltaNetMixer needs model_cfg (the spec builder passes it)"
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp
        tp, r = self.tp_group.size(), self.tp_group.rank()
        self.hk, self.hv = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
        self.dk, self.dv = m.linear_key_head_dim, m.linear_value_head_dim
        self.conv_width = m.linear_conv_kernel_dim
        self.chunk_size = m.gdn_chunk_size
        self.state_dtype = m.state_dtype
        dtype = config.params_dtype
        Hd = config.hidden_size

        def col(out_features):
            return submodules.in_proj(Hd, out_features, config=config, init_method=config.init_method, bias=False,
                                      gather_output=False, skip_bias_add=True, tp_group=self.tp_group)

        self.in_proj_q = col(m.linear_num_key_heads * self.dk)
        self.in_proj_k = col(m.linear_num_key_heads * self.dk)
        self.in_proj_v = col(m.linear_num_value_heads * self.dv)
        self.in_proj_z = col(m.linear_num_value_heads * self.dv)
        self.in_proj_b = col(m.linear_num_value_heads)
        self.in_proj_a = col(m.linear_num_value_heads)
        # Own parameters are drawn in full from a generator keyed by (run seed, layer) and sliced, so
        # every TP size starts from the same full weights (as Megatron's use_cpu_initialization does).
        seed, tag = torch.initial_seed(), f"layer{layer_number}"
        W = self.conv_width
        std = config.init_method_std

        def normal(t, g):
            return t.normal_(0.0, std, generator=g)

        self.conv_q = full_then_shard((m.linear_num_key_heads * self.dk, W), normal, r, tp, dtype, seed, tag + "cq")
        self.conv_k = full_then_shard((m.linear_num_key_heads * self.dk, W), normal, r, tp, dtype, seed, tag + "ck")
        self.conv_v = full_then_shard((m.linear_num_value_heads * self.dv, W), normal, r, tp, dtype, seed, tag + "cv")
        self.A_log = full_then_shard((m.linear_num_value_heads,), lambda t, g: t.uniform_(1.0, 16.0, generator=g).log_(),
                                     r, tp, dtype, seed, tag + "A")
        self.dt_bias = full_then_shard((m.linear_num_value_heads,), lambda t, g: t.fill_(1.0), r, tp, dtype, seed,
                                       tag + "dt")
        self.norm = GatedRMSNorm(self.dv, eps=m.rms_norm_eps, tp_group=self.tp_group, dtype=dtype)
        self.out_proj = submodules.out_proj(m.linear_num_value_heads * self.dv, Hd, config=config,
                                            init_method=config.output_layer_init_method, bias=False,
                                            input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)

    def _core(self, q, k, v, b, a, heads: tuple[int, int], state: GDNState | None, window=None):
        """Conv + gated delta rule of q/k heads [h0, h1) (of this TP rank's) and the value heads they
        serve, from `state` to the returned one. q, k [B, T, h, Dk] and v [B, T, h*r, Dv] pre-conv,
        b, a [B, T, h*r]. State conv window [B, Ch_h, W-1] with channels [q | k | v] of those heads.
        Returns (o [B, T, h*r, Dv] in the state dtype, new state). With `window` (a conv window as
        above; sequence-parallel context parallelism, parallel/cp_gdn.py) the tokens are a piece whose
        entering recurrent state is not known yet: returns (its ops/gdn_pieces.PieceMaps, None)."""
        h0, h1 = heads
        r = self.hv // self.hk
        B, T = q.shape[:2]
        nq, nv = (h1 - h0) * self.dk, (h1 - h0) * r * self.dv
        mixed = torch.cat([q.reshape(B, T, nq), k.reshape(B, T, nq), v.reshape(B, T, nv)], dim=-1)
        conv_w = torch.cat([self.conv_q[h0 * self.dk:h1 * self.dk], self.conv_k[h0 * self.dk:h1 * self.dk],
                            self.conv_v[h0 * r * self.dv:h1 * r * self.dv]], dim=0)          # [Ch_h, W]
        piece = window is not None
        if not piece:
            window = state.conv if state is not None else None
        mixed, conv_state = conv_kernel(mixed).causal_conv1d(mixed, conv_w, window, activation="silu")
        q, k, v = torch.split(mixed, [nq, nq, nv], dim=-1)
        q = q.reshape(B, T, h1 - h0, self.dk)
        k = k.reshape(B, T, h1 - h0, self.dk)
        v = v.reshape(B, T, (h1 - h0) * r, self.dv)
        sd = self.state_dtype
        A_log, dt_bias = self.A_log[h0 * r:h1 * r], self.dt_bias[h0 * r:h1 * r]
        beta = torch.sigmoid(b.to(sd))                                            # [B, T, h*r]
        g = -A_log.to(sd).exp() * F.softplus(a.to(sd) + dt_bias.to(sd))
        if piece:
            return piece_maps(q, k, v, g, beta, chunk_size=self.chunk_size, state_dtype=sd), None
        o, rec = gdn_kernel(v, self.dk).chunk_gated_delta_rule(q, k, v, g, beta,
                                                               state.recurrent if state is not None else None,
                                                               chunk_size=self.chunk_size, state_dtype=sd)
        return o, GDNState(conv=conv_state, recurrent=rec)

    def _mix(self, hidden_states, ctx):
        """Token-local projections, then the sequence core through the context (which handles the
        state, and under context parallelism the head/sequence exchange). Returns o [B, T, Hv, Dv]."""
        T, B, _ = hidden_states.shape
        q, _ = self.in_proj_q(hidden_states)
        k, _ = self.in_proj_k(hidden_states)
        v, _ = self.in_proj_v(hidden_states)
        b, _ = self.in_proj_b(hidden_states)
        a, _ = self.in_proj_a(hidden_states)
        inputs = (q.transpose(0, 1).reshape(B, T, self.hk, self.dk), k.transpose(0, 1).reshape(B, T, self.hk, self.dk),
                  v.transpose(0, 1).reshape(B, T, self.hv, self.dv), b.transpose(0, 1), a.transpose(0, 1))
        return ctx.recurrent(self.layer_number, self._core, inputs, self.hk, self.conv_width)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, **kwargs):
        """hidden_states [T, B, Hd] -> (out [T, B, Hd], None). Reads/writes `GDNState` via the context
        (`NO_STATE` without one: the core starts from no state)."""
        T, B, _ = hidden_states.shape
        o = self._mix(hidden_states, inference_context if inference_context is not None else NO_STATE)
        z, _ = self.in_proj_z(hidden_states)
        z = z.transpose(0, 1).reshape(B, T, self.hv, self.dv)
        o = self.norm(o.to(hidden_states.dtype), z).reshape(B, T, self.hv * self.dv)
        out, _ = self.out_proj(o.transpose(0, 1).contiguous())
        return out, None

    def produce_state(self, hidden_states, inference_context) -> None:
        """Only the state after the call, handed to the context (no gate, norm or output projection):
        exact mode's recompute of the model's last layer, whose output feeds nothing."""
        self._mix(hidden_states, inference_context)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return sharded_state_dict_with_tp_params(self, self._TP_PARAMS, prefix, sharded_offsets, metadata,
                                                 self.tp_group)
