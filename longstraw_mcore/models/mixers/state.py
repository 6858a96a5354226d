"""Per-layer cached state that mixers read (earlier positions) and, on request, write.

The model is run with a `StateContext` passed through Megatron's `inference_context` slot; it is the
only way branch-replay concerns reach layer code. A mixer asks `ctx.read(layer_number)` for the
state of earlier positions (None = start of sequence), uses `ctx.position_offset` as the absolute
position of its first token, and, when `ctx.collect` is set, hands back what its tokens add with
`ctx.write(layer_number, state)`: attention the K/V of its own positions, GDN its whole state after
them. What a context does with that (keep, append into a preallocated buffer, record with its
graph) is the context's business: `StateContext` here keeps a plain dict (tests, simple use);
prompt_state/ holds the capture / replay / recompute contexts. Layer numbers are Megatron's
global 1-based ones.

Shapes (local to the TP rank): attention k/v `[B, P, Hk, D]` after k-norm and RoPE; GDN conv window
`[B, Ch, W-1]` (Ch = local q, k, v channels in that order), recurrent `[B, Hv, Dk, Dv]` in
>= float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionState:
    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self):
        assert self.k.shape == self.v.shape and self.k.dim() == 4, (self.k.shape, self.v.shape)

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class GDNState:
    conv: torch.Tensor
    recurrent: torch.Tensor

    def __post_init__(self):
        assert self.conv.dim() == 3 and self.recurrent.dim() == 4, (self.conv.shape, self.recurrent.shape)
        assert self.recurrent.dtype in (torch.float32, torch.float64), self.recurrent.dtype

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()


class StateContext:
    """Carries cached state into the mixers and collects their new state."""

    store_attention_probs = False
    """Attention may keep its probabilities over the cached positions for the backward (no score
    recompute) instead of O(queries x block) memory; set by a context that has checked they fit."""

    def __init__(self, position_offset: int = 0, states: dict | None = None, collect: bool = False):
        if position_offset < 0:
            raise ValueError(f"position_offset={position_offset}: must be >= 0")
        self.position_offset = position_offset
        self.states = dict(states or {})
        self.collect = collect
        self.new_states: dict = {}

    def read(self, layer_number: int):
        return self.states.get(layer_number)

    def write(self, layer_number: int, state) -> None:
        """Attention writes the K/V of its own positions (appended to what it read); GDN writes its
        whole state after this call."""
        if not self.collect:
            return
        old = self.states.get(layer_number)
        if isinstance(state, AttentionState) and old is not None:
            state = AttentionState(k=torch.cat([old.k, state.k], 1), v=torch.cat([old.v, state.v], 1))
        self.new_states[layer_number] = state

    # Megatron's TransformerLayer/Block only query these under CUDA-graph inference; answer plainly.
    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return False
