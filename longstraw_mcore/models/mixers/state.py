"""Per-layer cached state that mixers read (earlier positions) and, on request, write.

The model is run with a context passed through Megatron's `inference_context` slot; it is the only
way branch-replay concerns reach layer code, through one hook per mixer type (`StateHooks` below
holds the single-rank defaults; context parallelism overrides them in prompt_state/contexts.py):
- every mixer: `ctx.positions(S, device)`, the absolute positions of the call's S tokens (RoPE);
- attention: `ctx.key_sets(layer_number, k, v)` with the K/V of the call's own positions returns the
  key sets (`ops.attention.KeySet`) its queries attend to (earlier positions and its own), and
  `ctx.attend(q, key_sets, q_start, block, kv)` computes the attention over them (`kv`: the layer's KV
  group when TP exceeds the KV heads);
- Gated DeltaNet: `ctx.recurrent(layer_number, core, inputs, n_k_heads)` runs the mixer's sequence
  core (conv + delta rule over a head range, from an entering state to a leaving one) on the call's
  tokens; by default through `ctx.read(layer_number)` (the state entering the call, None = start of
  sequence) and `ctx.write(layer_number, state)` (its whole state after the call).
What a context does with them (keep, copy into a preallocated buffer, record with its graph) is the
context's business: `StateContext` here keeps a plain dict (tests, simple use); prompt_state/ holds
the capture / replay / recompute contexts. Layer numbers are Megatron's global 1-based ones.

Shapes (local to the TP rank): attention k/v `[B, P, Hk, D]` after k-norm and RoPE; GDN conv window
`[B, Ch, W-1]` (Ch = local q, k, v channels in that order), recurrent `[B, Hv, Dk, Dv]` in
>= float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longstraw_mcore.ops.attention import KeySet, attention


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


class StateHooks:
    """The single-rank hooks every context shares (see the module docstring)."""

    position_offset: int = 0

    def positions(self, S: int, device) -> torch.Tensor:
        return torch.arange(self.position_offset, self.position_offset + S, device=device)

    def attend(self, q: torch.Tensor, keys: list[KeySet], q_start: int, block: int, kv=None):
        """`kv`: the layer's KV group when tp exceeds the KV heads (parallel/kv_group.py)."""
        if kv is not None:
            from longstraw_mcore.parallel.kv_group import group_attention

            return group_attention(q, [k for k in keys if k.local], [k for k in keys if not k.local], q_start, kv,
                                   block=block)
        return attention(q, keys, q_start, block=block)

    def recurrent(self, layer_number: int, core, inputs: tuple, n_k_heads: int):
        out, new = core(*inputs, heads=(0, n_k_heads), state=self.read(layer_number))
        self.write(layer_number, new)
        return out

    # Megatron's TransformerLayer/Block only query these under CUDA-graph inference; answer plainly.
    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return False


class StateContext(StateHooks):
    """Carries cached state into the mixers and, with `collect`, collects their new state."""

    def __init__(self, position_offset: int = 0, states: dict | None = None, collect: bool = False):
        if position_offset < 0:
            raise ValueError(f"position_offset={position_offset}: must be >= 0")
        self.position_offset = position_offset
        self.states = dict(states or {})
        self.collect = collect
        self.new_states: dict = {}

    def read(self, layer_number: int):
        return self.states.get(layer_number)

    def key_sets(self, layer_number: int, k: torch.Tensor, v: torch.Tensor) -> list[KeySet]:
        old = self.states.get(layer_number)
        if old is not None and old.length != self.position_offset:
            raise ValueError(f"layer {layer_number}: cached K/V hold {old.length} positions but the position "
                             f"offset is {self.position_offset}")
        self.write(layer_number, AttentionState(k=k, v=v))
        own = KeySet(k, v, self.position_offset)
        return [own] if old is None or old.length == 0 else [KeySet(old.k, old.v, 0), own]

    def write(self, layer_number: int, state) -> None:
        """Attention writes the K/V of its own positions (appended to what it read); GDN writes its
        whole state after this call."""
        if not self.collect:
            return
        old = self.states.get(layer_number)
        if isinstance(state, AttentionState) and old is not None:
            state = AttentionState(k=torch.cat([old.k, state.k], 1), v=torch.cat([old.v, state.v], 1))
        self.new_states[layer_number] = state
