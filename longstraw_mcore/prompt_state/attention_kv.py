"""Prompt state of a full-attention layer: K (after k-norm and RoPE) and V of every captured position.

Legend: P_c captured positions (prompt length - 1), Hk kv heads local to this TP rank, D head dim.

    capture   chunk [s0, s1): its K/V are copied into the preallocated buffers [1, P_c, Hk, D], and
              its queries attend causally to buffer[:, :s1] in one call (no merge)
    replay    a branch at positions P_c.. attends to {buffer (start 0), its own K/V (start P_c)},
              merged in one attention node; the buffers are read in place, never copied
    exact     the buffers get float32 gradient accumulators (float64 under float64) that the
              attention backward adds dK/dV into block by block (no autograd leaf, no full-size
              temporary per branch); chunk c's recompute attends to buffer[:, :s0] with the
              accumulators' [:s0] as its sink, and is seeded with accumulator[:, s0:s1] for the K/V
              it recomputes
Bytes: 2 Hk D P_c in the model dtype (state); 2 Hk D P_c in float32 more while exact mode runs.
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops.attention import KeySet
from longstraw_mcore.prompt_state.base import LayerState, grad_dtype


def _elt(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class AttentionKV(LayerState):
    kind = "attention_kv"

    def __init__(self, m, tp: int, captured: int, device, batch: int = 1):
        shape = (batch, captured, m.num_key_value_heads // tp, m.head_dim)
        self.k = torch.zeros(shape, dtype=m.torch_dtype, device=device)
        self.v = torch.zeros(shape, dtype=m.torch_dtype, device=device)
        self.length = 0                                  # positions written so far
        self.grad: tuple[torch.Tensor, torch.Tensor] | None = None
        self.produced: tuple[torch.Tensor, torch.Tensor] | None = None
        self.span = (0, 0)

    # --- capture: write this chunk's K/V, attend to everything up to its end -----------------------
    def capture_keys(self, k: torch.Tensor, v: torch.Tensor, offset: int) -> list[KeySet]:
        t = k.shape[1]
        if self.length != offset or offset + t > self.k.shape[1]:
            raise ValueError(f"attention state holds {self.length} of {self.k.shape[1]} positions; a chunk of {t} "
                             f"at offset {offset} does not continue it")
        assert k.shape[0] == self.k.shape[0] and k.shape[2:] == self.k.shape[2:] and k.dtype == self.k.dtype, \
            (k.shape, k.dtype, self.k.shape, self.k.dtype)
        self.k[:, offset:offset + t].copy_(k)
        self.v[:, offset:offset + t].copy_(v)
        self.length = offset + t
        return [KeySet(self.k[:, :self.length], self.v[:, :self.length], 0)]

    # --- replay: the whole prompt (read in place) and the branch's own keys -----------------------
    def replay_keys(self, k: torch.Tensor, v: torch.Tensor, offset: int, store_probs: bool) -> list[KeySet]:
        if offset != self.length:
            raise ValueError(f"attention state holds {self.length} positions but the branch starts at {offset}")
        own = KeySet(k, v, offset)
        if self.length == 0:
            return [own]
        return [KeySet(self.k, self.v, 0, grad=self.grad, store_probs=store_probs), own]

    # --- exact mode ------------------------------------------------------------------------------
    def enable_grad(self) -> None:
        assert self.k.shape[0] == 1, "state gradients are kept for one prompt (batch 1)"
        dt = grad_dtype(self.k.dtype)
        self.grad = (torch.zeros(self.k.shape, dtype=dt, device=self.k.device),
                     torch.zeros(self.v.shape, dtype=dt, device=self.v.device))

    def release_grad(self) -> None:
        self.grad, self.produced = None, None

    def recompute_keys(self, k: torch.Tensor, v: torch.Tensor, span: tuple[int, int]) -> list[KeySet]:
        s0, s1 = span
        assert self.grad is not None and k.shape[1] == s1 - s0, (k.shape, span)
        self.produced, self.span = (k, v), span
        own = KeySet(k, v, s0)
        if s0 == 0:
            return [own]
        return [KeySet(self.k[:, :s0], self.v[:, :s0], 0, grad=(self.grad[0][:, :s0], self.grad[1][:, :s0])), own]

    def seeds(self, chunk: int):
        assert self.produced is not None, "the recompute did not reach this layer"
        s0, s1 = self.span
        return list(self.produced), [self.grad[0][:, s0:s1], self.grad[1][:, s0:s1]]

    def finish_chunk(self, chunk: int) -> None:
        self.produced = None

    # --- memory ----------------------------------------------------------------------------------
    def kept(self):
        return {"attention_kv": [self.k, self.v]}

    def grad_tensors(self):
        return list(self.grad) if self.grad is not None else []

    @classmethod
    def analytic_bytes(cls, m, tp: int, captured: int, exact_chunks: int, batch: int = 1) -> dict[str, int]:
        return {"attention_kv": 2 * (m.num_key_value_heads // tp) * m.head_dim * captured * _elt(m.torch_dtype) * batch}

    @classmethod
    def analytic_grad_bytes(cls, m, tp: int, captured: int) -> int:
        return 2 * (m.num_key_value_heads // tp) * m.head_dim * captured * _elt(grad_dtype(m.torch_dtype))

    @classmethod
    def probs_bytes(cls, m, tp: int, batch: int, tokens: int, captured: int) -> int:
        """A branch's attention probabilities over the prompt when kept for the backward (>= float32)."""
        return (m.num_attention_heads // tp) * batch * tokens * captured * _elt(grad_dtype(m.torch_dtype))
