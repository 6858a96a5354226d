"""Prompt state of a GLM-5.3-Flash MLA layer whose indexer scores pools of tokens ("full" layers): the MLA latent
per position as prompt_state/mla.py keeps it (striped over the TP group, sharded over CP), and instead of an index
key per position the pooled keys of the prompt's complete pools plus the raw keys of its incomplete last pool.

Legend: kpool tokens per pool (pools aligned to position 0), Di indexer head dim, P complete pools.

    pooled [1, P, Di], ends [P]   each complete pool's key (ops/dsa_pool.py pool_keys) and last position
    tail_k, tail_g [1, t, Di]     the raw index keys and gate scores of the t < kpool tokens after the last
                                  complete pool (positions tail_start ..), which a later call completes

The pooled part is replicated on every rank (Di / kpool values per position: GLM-5.3-Flash in bf16, 16 bytes per
position and layer, about 1/64 of the latent), so every rank chooses the same pools without exchanging proposals;
a capture chunk's raw keys are gathered over CP before pooling (prompt_state/contexts.py).

    capture   the chunk's tokens (all of them, in order) complete the tail's pool and form new ones; the keys
              handed back carry every complete pool up to the chunk's end (`MLAKeys.pools`)
    replay    a branch's pools: the prompt's, then those its raw tokens (the prompt's tail, a prefix tree's
              segments, its own) complete, per branch row
    exact     the indexer gets no gradient and the prompt's pools are all known after the capture: a chunk's
              recompute sees them all (a pool ending after a query is not a candidate for it)

Bytes: the latents as mla.py counts them ("mla_latent": staged, moved by memory.state_offload / fp8) and the pools
with the raw tail ("dsa_pooled_keys": resident, 1/kpool of an index key per position).
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops.dsa_pool import pool_keys
from longstraw_mcore.prompt_state.base import element_size
from longstraw_mcore.prompt_state.hooks import MLAKeys
from longstraw_mcore.prompt_state.mla import MLALatentState


class MLAPoolIndexerState(MLALatentState):
    kind = "mla_latent_pool"
    indexer = False  # no index key per position

    def __init__(self, m, tp: int, captured: int, device, batch: int = 1, kv=None, spans=None, **kw):
        super().__init__(m, tp, captured, device, batch, kv, spans, **kw)
        self.kpool, total = m.index_kpool, (spans[-1][1] if spans else captured)
        self.pooled = torch.zeros(batch, total // self.kpool, m.index_head_dim, dtype=self.dtype, device=device)
        self.ends = torch.zeros(total // self.kpool, dtype=torch.long, device=device)
        self.n_pools = 0
        self.tail_k = self.tail_g = None

    @property
    def tail_start(self) -> int:
        return self.n_pools * self.kpool

    def _pools(self):
        return self.pooled[:, :self.n_pools], self.ends[:self.n_pools]

    def _raw(self, k, g, start: int, B: int):
        """The tail's raw rows, then `k`, `g` of positions `start` .. (which must continue the tail)."""
        held = 0 if self.tail_k is None else self.tail_k.shape[1]
        if start != self.tail_start + held:
            raise ValueError(f"pooled index state: raw keys at position {start} do not continue its tail "
                             f"(positions {self.tail_start}..{self.tail_start + held - 1})")
        if self.tail_k is None:
            return k, g
        return (torch.cat([self.tail_k.expand(B, -1, -1), k.to(self.tail_k.dtype)], 1),
                torch.cat([self.tail_g.expand(B, -1, -1), g.to(self.tail_g.dtype)], 1))

    # --- capture --------------------------------------------------------------------------------
    def capture_latent(self, own: MLAKeys, local_offset: int, raw: tuple | None = None) -> MLAKeys:
        """`raw`: (k, g, first position) of the whole chunk's raw index keys where `own` holds only this rank's
        rows of it (context parallelism); else own's."""
        keys = super().capture_latent(own, local_offset)
        k, g, start = raw if raw is not None else (own.ik, own.ig, int(own.pos[0]))
        k, g = self._raw(k, g, start, k.shape[0])
        ape, kpool = own.pooling
        pooled, ends = pool_keys(k, g, ape, kpool, self.tail_start)
        n, P = self.n_pools, pooled.shape[1]
        if n + P > self.ends.shape[0]:
            raise ValueError(f"pooled index state holds {self.ends.shape[0]} pools; a chunk completes {P} more after "
                             f"{n}")
        self.pooled[:, n:n + P].copy_(pooled)
        self.ends[n:n + P] = ends
        self.n_pools = n + P
        rest = k.shape[1] - P * kpool
        self.tail_k, self.tail_g = (k[:, -rest:].clone(), g[:, -rest:].clone()) if rest else (None, None)
        keys.pools = self._pools()
        return keys

    # --- replay ---------------------------------------------------------------------------------
    def replay_latent(self, own: MLAKeys, own_counted: bool = True) -> MLAKeys:
        """`own`: the branch's latents (after a prefix tree's path: its raw keys too), from the prompt's end on."""
        keys = super().replay_latent(own, own_counted)
        B = own.c.shape[0]
        k, g = self._raw(own.ik, own.ig, int(own.pos[0]), B)
        ape, kpool = own.pooling
        pooled, ends = pool_keys(k, g, ape, kpool, self.tail_start)
        head, head_ends = self._pools()
        keys.pools = ((head, pooled), torch.cat([head_ends, ends]))
        return keys

    # --- exact mode -----------------------------------------------------------------------------
    def recompute_latent(self, own: MLAKeys, chunk: int, local_span: tuple[int, int],
                         deposit_scale: float = 1.0) -> MLAKeys:
        keys = super().recompute_latent(own, chunk, local_span, deposit_scale)
        keys.pools = self._pools()
        return keys

    # --- memory ---------------------------------------------------------------------------------
    def kept(self):
        out = super().kept()
        out["dsa_pooled_keys"] = [self.pooled] + [t for t in (self.tail_k, self.tail_g) if t is not None]
        return out

    @classmethod
    def analytic_bytes(cls, m, tp: int, captured: int, exact_chunks: int, batch: int = 1, cp: int = 1) -> dict:
        """The latent stripe (mla.py), and the pools of the whole prompt, replicated, with the raw tail's keys and gate
        scores (the prompt taken as `captured` x cp positions: exact at cp = 1)."""
        out = super().analytic_bytes(m, tp, captured, exact_chunks, batch, cp)
        total, e = captured * cp, element_size(m.torch_dtype)
        out["dsa_pooled_keys"] = (total // m.index_kpool + 2 * (total % m.index_kpool)) * m.index_head_dim * e * batch
        return out
