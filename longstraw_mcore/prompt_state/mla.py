"""Prompt state of an MLA + DSA layer (GLM-5.x): per captured position the latent c_kv (kv_lora_rank,
after its norm) and the RoPE key k_pe (after RoPE), and on "full" indexer layers the indexer key;
"shared" layers keep no indexer key (they reuse the previous full layer's selection).

Legend: P_c captured positions, R kv_lora_rank, Dr RoPE dims, Di indexer head dim.

    capture   chunk [s0, s1): its latents are copied into the preallocated buffers [1, P_c, .] and
              its queries see buffer[:, :s1] (one call: earlier chunks and their own causally)
    replay    a branch at positions P_c.. sees {the buffers, its own latents}; the per-head K/V are
              never expanded (ops/dsa.py's absorbed attention reads the latent directly)
    exact     the buffers get autograd leaves (float32, float64 under float64) whose gradients
              accumulate over branches; chunk c's recompute sees the leaves' rows before it and its own
              recomputed latents, and is seeded with the accumulated gradient of its rows

Bytes per position: (R + Dr) in the model dtype, + Di on full indexer layers. GLM-5.2 in bf16:
78 x 576 x 2 + 21 x 128 x 2 = 95,232 B per position. Exact mode adds the float32 leaves' gradient
(and, below float32, a float32 copy of the state).

Sharded by sequence: under context parallelism each rank keeps its zig-zag share of every chunk's
rows, and inside the TP group (one latent serves every head) TP rank t keeps every n-th of those
(rows i with i % n = t): 1/(tp cp) of the positions per rank, with their global positions
(parallel/cp_dsa.py selects and attends across the ranks).

The state and a call's own rows reach the attention as a (head, tail) pair of their rows (`_cat`), never
joined by the DSA kernels (ops/dsa_triton_*.py): no per-call copy of the state, and gradient buffers of
each part's own size (none for a detached state). The plain twins join them, and their gather's
backward still materialises the latents' gradient at full prompt size per layer.
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops.scale_grad import scale_grad
from longstraw_mcore.prompt_state.base import LayerState, element_size, grad_dtype
from longstraw_mcore.prompt_state.hooks import MLAKeys


def _cat(a, b):
    """The state's rows and the call's own, as a (head, tail) pair: the DSA kernels read them where they
    lie, the twins join them (ops/dsa.py joined_rows: the head of batch 1 expanded to the call's batch)."""
    return a, b.to(a.dtype)



class MLALatentState(LayerState):
    kind = "mla_latent"
    indexer = False
    staged = ("c", "pe", "ik")
    exact_rows = ("ik",)  # the indexer's keys choose the top-k: not rounded to fp8 (memory/staging.py)

    def __init__(self, m, tp: int, captured: int, device, batch: int = 1, kv=None, spans=None, **_):
        self.dtype = m.torch_dtype
        # `kv`: the TP group (one latent serves every head): row i of this rank's positions is kept by
        # TP rank i % n only (a stripe), not replicated
        self.kv = kv
        self.n, self.r = (kv.size, kv.rank) if kv is not None else (1, 0)
        rows = len(range(self.r, captured, self.n))
        self.c = torch.zeros(batch, rows, m.kv_lora_rank, dtype=self.dtype, device=device)
        self.pe = torch.zeros(batch, rows, m.qk_rope_head_dim, dtype=self.dtype, device=device)
        self.ik = torch.zeros(batch, rows, m.index_head_dim, dtype=self.dtype, device=device) \
            if self.indexer else None
        # the global position of each row (under CP this rank's zig-zag shares of the chunks; bookkeeping,
        # not state: 8 B per position and layer kind, not counted in `kept`)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.length = 0
        self.leaves: tuple | None = None
        self.produced: dict = {}

    def _before(self, i: int) -> int:
        """This rank's stored rows among the first i of its positions."""
        return len(range(self.r, i, self.n))

    def _stripe(self, a: int, b: int, device) -> torch.Tensor:
        """Which of positions [a, b) (this rank's numbering) this TP rank stores."""
        return torch.arange(a, b, device=device) % self.n == self.r

    # --- capture --------------------------------------------------------------------------------
    def capture_latent(self, own: MLAKeys, local_offset: int) -> MLAKeys:
        t = own.c.shape[1]
        lo = self._before(local_offset)
        keep = self._stripe(local_offset, local_offset + t, own.c.device)
        end = lo + int(keep.sum())
        if self.length != lo or end > self.c.shape[1]:
            raise ValueError(f"MLA state holds {self.length} of {self.c.shape[1]} rows; a chunk of {t} positions at "
                             f"offset {local_offset} does not continue it")
        self.c[:, lo:end].copy_(own.c[:, keep])
        self.pe[:, lo:end].copy_(own.pe[:, keep])
        if self.ik is not None:
            self.ik[:, lo:end].copy_(own.ik[:, keep])
        self.pos[lo:end] = own.pos[keep]
        self.length = end
        return MLAKeys(self.c[:, :end], self.pe[:, :end], None if self.ik is None else self.ik[:, :end],
                       self.pos[:end])

    # --- replay ---------------------------------------------------------------------------------
    def _state(self, end: int):
        """The state's rows before `end`, as the graph should see them (leaves in exact mode)."""
        if self.leaves is None:
            return [t[:, :end] if t is not None else None for t in (self.c, self.pe, self.ik)]
        # (the leaves live with the state's home: in host memory with memory.state_offload)
        device = self.pos.device
        c, pe = (x[:, :end].to(device=device, dtype=self.dtype) for x in self.leaves)
        return [c, pe, None if self.ik is None else self.ik[:, :end]]

    def replay_latent(self, own: MLAKeys, own_counted: bool = True) -> MLAKeys:
        """The state and the branch's own latents; `own_counted=False` (CP ranks other than 0): the own
        rows are present (their gradient path runs on every rank) but not counted here."""
        c, pe, ik = self._state(self.length)
        counted = None
        if not own_counted or self.r != 0:  # the branch's own keys count on one rank of the TP group
            counted = torch.arange(self.length + own.pos.shape[0], device=own.pos.device) < self.length
        return MLAKeys(_cat(c, own.c), _cat(pe, own.pe), None if ik is None else _cat(ik, own.ik),
                       torch.cat([self.pos[:self.length], own.pos]), counted)

    # --- exact mode -----------------------------------------------------------------------------
    def enable_grad(self) -> None:
        dt = grad_dtype(self.dtype)
        # the indexer key gets no gradient: the selection is not differentiable
        self.leaves = tuple(x.detach().to(dt).requires_grad_(True) for x in (self.c, self.pe))

    def release_grad(self) -> None:
        self.leaves, self.produced = None, {}

    def recompute_latent(self, own: MLAKeys, chunk: int, local_span: tuple[int, int],
                         deposit_scale: float = 1.0) -> MLAKeys:
        """`deposit_scale`: what the chunk's backward deposits into the earlier rows' gradient is scaled
        by it (1/n under CP, whose recompute seeds are n times the gradient: prompt_state/contexts.py)."""
        ls0, ls1 = local_span
        assert self.leaves is not None and own.c.shape[1] == ls1 - ls0, (own.c.shape, local_span)
        self.produced.setdefault(chunk, (own.c, own.pe, local_span))  # a recompute keeps the first (attention_kv.py)
        lo = self._before(ls0)
        c, pe, ik = self._state(lo)
        c, pe = scale_grad(c, deposit_scale), scale_grad(pe, deposit_scale)
        counted = None
        if self.n > 1:  # the chunk's own rows are computed on every TP rank; each counts its stripe
            counted = torch.cat([torch.ones(lo, dtype=torch.bool, device=own.c.device),
                                 self._stripe(ls0, ls1, own.c.device)])
        return MLAKeys(_cat(c, own.c), _cat(pe, own.pe), None if ik is None else _cat(ik, own.ik),
                       torch.cat([self.pos[:lo], own.pos]), counted)

    def outputs(self, chunk: int) -> list[torch.Tensor]:
        assert chunk in self.produced, f"the recompute of chunk {chunk} did not reach this layer"
        return list(self.produced[chunk][:2])

    def seed_grads(self, chunk: int) -> list[torch.Tensor]:
        """The gradient of the chunk's rows: this rank's stripe, assembled over the TP group (every TP
        rank recomputes all of the chunk's latents)."""
        ls0, ls1 = self.produced[chunk][2]
        lo, hi = self._before(ls0), self._before(ls1)
        out = [x.grad[:, lo:hi] if x.grad is not None else torch.zeros_like(x[:, lo:hi]) for x in self.leaves]
        if self.n == 1:
            return out
        import torch.distributed as dist

        # (on the run's device: with memory.state_offload the leaves and their gradients are host memory)
        device = self.pos.device
        keep = self._stripe(ls0, ls1, device)
        full = []
        for g in out:
            f = torch.zeros(g.shape[0], ls1 - ls0, g.shape[2], dtype=g.dtype, device=device)
            f[:, keep] = g.to(device)
            dist.all_reduce(f, group=self.kv.group)
            full.append(f)
        return full

    def finish_chunk(self, chunk: int) -> None:
        self.produced.pop(chunk, None)

    # --- memory ---------------------------------------------------------------------------------
    def kept(self):
        out = {"mla_latent": [self.c, self.pe]}
        if self.ik is not None:
            out["dsa_index_keys"] = [self.ik]
        return out

    def grad_tensors(self):
        if self.leaves is None:
            return []
        return list(self.leaves) + [x.grad for x in self.leaves if x.grad is not None]

    @classmethod
    def rows(cls, captured: int, tp: int) -> int:
        """The largest TP rank's stripe of this CP rank's `captured` positions."""
        return -(-captured // tp)

    @classmethod
    def analytic_bytes(cls, m, tp: int, captured: int, exact_chunks: int, batch: int = 1, cp: int = 1) -> dict:
        """The largest TP rank's: ceil(captured / tp) rows (a stripe of this CP rank's positions)."""
        e, rows = element_size(m.torch_dtype), cls.rows(captured, tp)
        out = {"mla_latent": (m.kv_lora_rank + m.qk_rope_head_dim) * rows * e * batch}
        if cls.indexer:
            out["dsa_index_keys"] = m.index_head_dim * rows * e * batch
        return out

    @classmethod
    def analytic_grad_bytes(cls, m, tp: int, captured: int) -> int:
        """The float32 leaves' gradients, and the float32 leaf copies when the model dtype is narrower."""
        n = (m.kv_lora_rank + m.qk_rope_head_dim) * cls.rows(captured, tp)
        copies = n if grad_dtype(m.torch_dtype) != m.torch_dtype else 0
        return (n + copies) * element_size(grad_dtype(m.torch_dtype))


class MLAIndexerState(MLALatentState):
    """A "full" indexer layer: the latent state plus the indexer key per position."""

    kind = "mla_latent_index"
    indexer = True
