"""Prompt state of a full-attention layer: K (after k-norm and RoPE) and V of every captured position.

Legend: P_c captured positions (prompt length - 1; under context parallelism this rank's share of
them, in chunk order), Hk kv heads local to this TP rank, D head dim.

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
from longstraw_mcore.parallel.cp import local_count, local_positions
from longstraw_mcore.prompt_state.base import LayerState, element_size, grad_dtype


def _heads(m, tp: int) -> int:
    """KV heads a TP rank holds: Hk / tp, or one (shared with its KV group) when tp exceeds Hk."""
    return max(m.num_key_value_heads // tp, 1)


def _positions(m, tp: int, captured: int) -> int:
    """Of `captured` positions (a CP rank's share), those one TP rank keeps: all, or its KV group's
    share (the largest rank's: ceil(captured / r), r = tp / Hk) when tp exceeds the KV heads."""
    r = tp // m.num_key_value_heads if tp > m.num_key_value_heads else 1
    return -(-captured // r)



class AttentionKV(LayerState):
    kind = "attention_kv"
    staged = ("k", "v")

    def __init__(self, m, tp: int, captured: int, device, batch: int = 1, kv=None, spans=None, cp=(1, 0)):
        self.kv = kv  # KV group (tp > KV heads): keep 1/r of the positions of this rank's one KV head
        if kv is not None:  # (under context parallelism 1/r of this CP rank's: `cp` = (size, rank))
            assert spans is not None, "a KV-group state needs the capture chunks"
            captured = sum(local_count(local_count(e - s, *cp), kv.size, kv.rank) for s, e in spans)
        self.group_spans: dict = {}  # KV group: prompt span of a chunk -> (its buffer rows, its positions)
        shape = (batch, captured, 1 if kv is not None else m.num_key_value_heads // tp, m.head_dim)
        self.k = torch.zeros(shape, dtype=m.torch_dtype, device=device)
        self.v = torch.zeros(shape, dtype=m.torch_dtype, device=device)
        self.length = 0                                  # positions written so far (this rank's)
        self.global_end = 0                              # the prompt position the state reaches
        self.grad: tuple[torch.Tensor, torch.Tensor] | None = None
        # exact mode: chunk -> (recomputed K, V, their buffer rows, KV group: their positions); more
        # than one chunk is in flight when a pipeline overlaps the recompute of chunk c-1 with the
        # backward of chunk c
        self.produced: dict = {}

    # --- capture: write this chunk's K/V, attend to everything up to its end -----------------------
    def capture_keys(self, k: torch.Tensor, v: torch.Tensor, local_offset: int, span: tuple[int, int],
                     merged: bool = True) -> list[KeySet]:
        """Copy the chunk's K/V (this rank's tokens of it) to the buffer at `local_offset`. `merged`
        (one rank): one key set over the buffer up to the chunk's end, one causal call; otherwise
        (context parallel) the earlier state's shard and the chunk's own keys, apart."""
        if self.kv is not None:
            return self._capture_group(k, v, span)
        t = k.shape[1]
        if self.length != local_offset or local_offset + t > self.k.shape[1]:
            raise ValueError(f"attention state holds {self.length} of {self.k.shape[1]} positions; a chunk of {t} "
                             f"at offset {local_offset} does not continue it")
        assert k.shape[0] == self.k.shape[0] and k.shape[2:] == self.k.shape[2:] and k.dtype == self.k.dtype, \
            (k.shape, k.dtype, self.k.shape, self.k.dtype)
        self.k[:, local_offset:local_offset + t].copy_(k)
        self.v[:, local_offset:local_offset + t].copy_(v)
        self.length, self.global_end = local_offset + t, span[1]
        if merged:
            return [KeySet(self.k[:, :self.length], self.v[:, :self.length], 0)]
        prior = [KeySet(self.k[:, :local_offset], self.v[:, :local_offset], 0)] if local_offset else []
        return prior + [KeySet(k, v, span[0])]

    def _capture_group(self, k, v, span):
        """KV group: the chunk's K/V (under context parallelism this CP rank's rows of it) are computed in
        full on every rank of the group; keep this rank's zig-zag share of those positions; attend to the
        group's state shards (a set on every rank once the prompt has begun, maybe empty: every rank of
        the group then runs the same collectives) and the chunk's keys."""
        s0, s1 = span
        idx = torch.tensor(local_positions(k.shape[1], self.kv.size, self.kv.rank), dtype=torch.long, device=k.device)
        lo = self.length
        self.k[:, lo:lo + len(idx)].copy_(k.index_select(1, idx))
        self.v[:, lo:lo + len(idx)].copy_(v.index_select(1, idx))
        self.group_spans[span] = ((lo, lo + len(idx)), idx)
        self.length, self.global_end = lo + len(idx), s1
        prior = [KeySet(self.k[:, :lo], self.v[:, :lo], 0, local=True)] if s0 else []
        return prior + [KeySet(k, v, s0)]

    # --- replay: the whole prompt (read in place) and the branch's own keys (last) -------------------
    def replay_keys(self, k: torch.Tensor, v: torch.Tensor, offset: int, store_probs: bool) -> list[KeySet]:
        if offset != self.global_end:
            raise ValueError(f"attention state covers {self.global_end} positions but the branch starts at {offset}")
        own = KeySet(k, v, offset)
        if (self.length if self.kv is None else self.global_end) == 0:  # (KV group: the same on every rank)
            return [own]
        return [KeySet(self.k, self.v, 0, grad=self.grad, store_probs=store_probs, local=self.kv is not None), own]

    # --- exact mode ------------------------------------------------------------------------------
    def enable_grad(self) -> None:
        """Allocate the accumulators (once: a chunk captured with its graph kept, replay.keep_prompt_graph_mib,
        holds sinks into them from its capture on)."""
        assert self.k.shape[0] == 1, "state gradients are kept for one prompt (batch 1)"
        if self.grad is not None:
            return
        dt = grad_dtype(self.k.dtype)
        self.grad = (torch.zeros(self.k.shape, dtype=dt, device=self.k.device),
                     torch.zeros(self.v.shape, dtype=dt, device=self.v.device))

    def release_grad(self) -> None:
        self.grad, self.produced = None, {}

    def recompute_keys(self, k: torch.Tensor, v: torch.Tensor, chunk: int, local_span: tuple[int, int],
                       span: tuple[int, int], deposit_scale: float = 1.0) -> list[KeySet]:
        idx = None
        if self.kv is not None:  # this rank's rows of the chunk, and of the state before it
            local_span, idx = self.group_spans[tuple(span)]
        ls0, ls1 = local_span
        assert self.grad is not None and (self.kv is not None or k.shape[1] == ls1 - ls0), (k.shape, local_span)
        # setdefault: memory.recompute=layer calls again in the backward; the roots are the first call's
        # (a recomputed tensor kept here would hold its whole recompute graph until finish_chunk)
        self.produced.setdefault(chunk, (k, v, local_span, idx))
        own = KeySet(k, v, span[0])
        if (ls0 if self.kv is None else span[0]) == 0:
            return [own]
        return [KeySet(self.k[:, :ls0], self.v[:, :ls0], 0, grad=(self.grad[0][:, :ls0], self.grad[1][:, :ls0]),
                       grad_scale=deposit_scale, local=self.kv is not None), own]

    def outputs(self, chunk: int) -> list[torch.Tensor]:
        assert chunk in self.produced, f"the recompute of chunk {chunk} did not reach this layer"
        return list(self.produced[chunk][:2])

    def seed_grads(self, chunk: int) -> list[torch.Tensor]:
        """The accumulated gradient of the K/V chunk `chunk` recomputed: complete once every branch
        and every later chunk has run its backward on this stage."""
        k, v, (ls0, ls1), idx = self.produced[chunk]
        if self.kv is None:
            return [self.grad[0][:, ls0:ls1], self.grad[1][:, ls0:ls1]]
        # KV group: the chunk's K/V are replicated in the group; their gradient is every position's,
        # assembled from the group's shards
        import torch.distributed as dist

        seeds = []
        for t, g in zip((k, v), self.grad):  # (on the run's device: the accumulators may be host memory)
            full = torch.zeros(t.shape, dtype=g.dtype, device=t.device)
            full.index_copy_(1, idx, g[:, ls0:ls1].to(t.device))
            dist.all_reduce(full, group=self.kv.group)
            seeds.append(full)
        return seeds

    def finish_chunk(self, chunk: int) -> None:
        self.produced.pop(chunk, None)

    # --- memory ----------------------------------------------------------------------------------
    def kept(self):
        return {"attention_kv": [self.k, self.v]}

    def grad_tensors(self):
        return list(self.grad) if self.grad is not None else []

    @classmethod
    def analytic_bytes(cls, m, tp: int, captured: int, exact_chunks: int, batch: int = 1, cp: int = 1) -> dict[str, int]:
        """`captured`: this CP rank's positions (its zig-zag share under context parallelism:
        parallel/cp.py), of which a KV group's rank keeps its share (`_positions`)."""
        return {"attention_kv": 2 * _heads(m, tp) * m.head_dim * _positions(m, tp, captured) *
                element_size(m.torch_dtype) * batch}

    @classmethod
    def analytic_grad_bytes(cls, m, tp: int, captured: int) -> int:
        return 2 * _heads(m, tp) * m.head_dim * _positions(m, tp, captured) * element_size(grad_dtype(m.torch_dtype))

    @classmethod
    def probs_bytes(cls, m, tp: int, batch: int, tokens: int, captured: int) -> int:
        """A branch's attention probabilities over the prompt when kept for the backward (>= float32)."""
        return (m.num_attention_heads // tp) * batch * tokens * captured * element_size(grad_dtype(m.torch_dtype))
