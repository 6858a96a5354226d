"""Captured prompt state for one rank: per full-attention layer the K/V of every captured position,
per Gated DeltaNet layer the conv window and recurrent state (and, in exact mode, the GDN state
entering every capture chunk, needed to recompute that chunk). Capture writes it; replay only reads.

Legend: B batch (1: one prompt), P_c captured positions (= prompt length - 1), Hk local kv heads,
D head dim, Ch local GDN conv channels, W conv width, Hv local value heads, Dk/Dv GDN head dims.
Byte counts are exact (`nbytes`) and match `analytic_state_bytes`, which the planner and the
tests share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw_mcore.config import ModelConfig
from longstraw_mcore.models.mixers.state import AttentionState, GDNState


@dataclass
class AttentionLayerBuffer:
    """K/V of captured positions, preallocated to the prompt length: `[B, P_c, Hk, D]`."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def view(self, upto: int | None = None) -> AttentionState:
        n = self.length if upto is None else upto
        return AttentionState(k=self.k[:, :n], v=self.v[:, :n])

    def append(self, new: AttentionState) -> None:
        t = new.k.shape[1]
        assert self.length + t <= self.k.shape[1], (self.length, t, self.k.shape)
        assert new.k.shape[2:] == self.k.shape[2:] and new.k.dtype == self.k.dtype, (new.k.shape, self.k.shape)
        self.k[:, self.length:self.length + t].copy_(new.k)
        self.v[:, self.length:self.length + t].copy_(new.v)
        self.length += t

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class GDNLayerState:
    """GDN state after the captured positions, and (exact mode) the state entering each chunk."""

    current: GDNState | None = None
    boundaries: list = field(default_factory=list)

    def nbytes(self) -> int:
        extra = sum(b.nbytes() for b in self.boundaries if b is not None)
        return (self.current.nbytes() if self.current is not None else 0) + extra


@dataclass
class PromptState:
    layers: dict                   # layer_number -> AttentionLayerBuffer | GDNLayerState
    length: int = 0                # captured positions
    chunk_bounds: list = field(default_factory=list)   # [(start, end)] of capture chunks

    def nbytes_by_type(self) -> dict[str, int]:
        out = {"attention_kv": 0, "gdn_state": 0, "gdn_chunk_boundaries": 0}
        for st in self.layers.values():
            if isinstance(st, AttentionLayerBuffer):
                out["attention_kv"] += st.nbytes()
            else:
                out["gdn_state"] += st.current.nbytes() if st.current is not None else 0
                out["gdn_chunk_boundaries"] += st.nbytes() - (st.current.nbytes() if st.current is not None else 0)
        return out

    def nbytes(self) -> int:
        return sum(self.nbytes_by_type().values())


def allocate(model_cfg: ModelConfig, layer_numbers: dict[int, str], tp: int, captured: int, device,
             batch: int = 1) -> PromptState:
    """Empty state for the given local layers (`{layer_number: 'full_attention'|'linear_attention'}`)."""
    m = model_cfg
    hk = m.num_key_value_heads // tp
    layers = {}
    for n, kind in layer_numbers.items():
        if kind == "full_attention":
            shape = (batch, captured, hk, m.head_dim)
            layers[n] = AttentionLayerBuffer(k=torch.zeros(shape, dtype=m.torch_dtype, device=device),
                                             v=torch.zeros(shape, dtype=m.torch_dtype, device=device))
        else:
            layers[n] = GDNLayerState()
    return PromptState(layers=layers)


def analytic_state_bytes(m: ModelConfig, tp: int, captured: int, exact_chunks: int = 0,
                         batch: int = 1) -> dict[str, int]:
    """Per-rank prompt-state bytes: 2*Hk*D per token per attention layer (model dtype); per GDN layer
    the conv window (W-1)*Ch (model dtype) + recurrent Hv*Dk*Dv (state dtype); exact mode adds one GDN
    state per capture chunk after the first (the state entering it)."""
    elt = torch.empty(0, dtype=m.torch_dtype).element_size()
    selt = torch.empty(0, dtype=m.state_dtype).element_size()
    n_attn = m.layer_types.count("full_attention")
    n_gdn = m.layer_types.count("linear_attention")
    attn = n_attn * 2 * (m.num_key_value_heads // tp) * m.head_dim * captured * elt * batch
    ch = (2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim) // tp
    per_gdn = ((m.linear_conv_kernel_dim - 1) * ch * elt
               + (m.linear_num_value_heads // tp) * m.linear_key_head_dim * m.linear_value_head_dim * selt) * batch
    gdn = n_gdn * per_gdn if captured > 0 else 0
    return {"attention_kv": attn, "gdn_state": gdn,
            "gdn_chunk_boundaries": n_gdn * per_gdn * max(exact_chunks - 1, 0)}
