"""The three ways a model run meets the prompt state (passed as the mixers' `inference_context`).

Mixers call the hooks of prompt_state/hooks.py and never see which context they run under:
attention `ctx.key_sets(layer, k, v)` then `ctx.attend(q, key_sets, q_start, block, kv)`, Gated
DeltaNet `ctx.recurrent(layer, core, inputs, n_k_heads)` (through `read` / `write`), MLA + DSA
`ctx.latent(layer, own)` (the latents its queries see: prompt_state/mla.py) then
`ctx.attend_latent(query, keys, own, tp_group, kv)`, every mixer `ctx.positions(T, device)`. Each
context forwards the state hooks to that layer's state kind for its phase:

- `CaptureContext`: a no-grad prompt chunk; kinds store what later tokens need (exact mode: GDN
  kinds also record the state entering the chunk).
- `ReplayContext`: a branch after the whole prompt; kinds hand out the state read-only (in exact mode
  with gradient accumulators / leaves); `write` is a no-op: a branch's own K/V and recurrent
  updates are scratch of its graph, freed with it.
- `RecomputeContext`: exact mode's reverse sweep, chunk c with autograd against the state before
  it; kinds record what the chunk produces, to be seeded with the accumulated gradient.
- `KeptCaptureContext`: exact mode's capture of a chunk whose graph is kept for the sweep
  (replay.keep_prompt_graph_mib): one autograd run that is both, the state stored as a capture stores
  it (detached) and the chunk's outputs recorded as its recompute would record them.

With context parallelism (`layout`: parallel/cp.py) a capture or recompute chunk holds this rank's
zig-zag pieces of the chunk, its positions are those pieces', attention is
`parallel.cp_attention.chunk_attention` (this rank's shard of the earlier state, the chunk's keys
gathered) and the GDN core runs on the whole chunk for this rank's 1/n of the heads
(`SeqToHeads` / `HeadsToSeq`), from and to a head-sharded state, or, where the key heads do not split
over CP (`parallel.cp.gdn_by_heads`), on this rank's pieces by an affine scan over the ranks
(`parallel.cp_gdn.sequence_recurrent`), from and to the whole state. A replayed branch is whole on every
rank: its attention is `replay_attention` (this rank's prompt shard, the branch's own keys counted
once), its GDN core reads the full final state. With KV groups as well (tp above the KV heads) both
kinds of call attend through `parallel.kv_group.group_cp_attention`. MLA + DSA over a sequence-sharded latent (context
parallelism, or the TP group's stripes) is `parallel.cp_dsa.attend_latent_sharded`: a chunk's queries
gathered over CP, every head's over the TP stripes, the top-k chosen globally and the attention
merged by log-sum-exp. In exact mode's recompute the seeds are scaled by
n and what the sweep deposits into state gradients by 1/n: the recomputed chunk's parameter
gradients are partial per rank (each rank recomputes 1/n of the tokens) while the replay's are
replicated, and Megatron DDP averages over data x context parallel ranks.

Why Gated DeltaNet goes to head shards where heads suffice rather than a scan over ranks (LASP-2). The
chunk update is affine in the entering state, S_out = M S_in + B (per head: Dk x Dk and Dk x Dv), so
ranks can compute (M, B) of their pieces, scan them, and correct their outputs by S_in
(parallel/cp_gdn.py does, where heads do not divide): it moves only Hv Dk (Dk + Dv) numbers per
piece, but every rank runs its tokens through the rule on values Dk wider (about twice the work when
Dk = Dv) and the states become replicated. The head exchange moves the chunk's GDN activations (one
all-to-all each way, parallel/cp_comm.py: a rank receives about (n-1)/n^2 T (2 h Dk + Hv Dv + 2 Hv)
values in and (n-1)/n^2 T Hv Dv out per layer and chunk) but each rank then does exactly 1/n of
the single-rank GDN work, no more, with nothing serialised, and its backward is the same exchange
reversed. Measured (tools/bench_cp.py, configs/qwen3.6-tiny.yaml, P=4096, chunks of 1024, CP=2,
bytes a rank receives per capture): the head exchange 144 all-to-alls, 4.69 MiB (its all-gathers
before: 9.37 MiB); the sequence path 36 all-gathers, 0.43 MiB. Megatron's own GDN shards by heads
(heads must then divide by tp x cp).
"""

from __future__ import annotations

import dataclasses

import torch

from longstraw_mcore.ops.attention import KeySet
from longstraw_mcore.parallel.cp import CPLayout, local_positions
from longstraw_mcore.prompt_state.containers import PromptState
from longstraw_mcore.prompt_state.hooks import GDNState, MLAKeys, StateHooks


class _Base(StateHooks):
    def __init__(self, state: PromptState, offset: int, layout: CPLayout | None = None):
        self.state, self.position_offset, self.layout = state, offset, layout

    def _cp_chunk(self) -> tuple[int, int] | None:
        """(chunk tokens, its first position) when this call's tokens are this rank's zig-zag pieces of a
        chunk split over context-parallel ranks; None otherwise (a replayed branch is whole on every rank)."""
        return None

    def attend_latent(self, query, keys, own, tp_group, kv=None):
        if self.layout is None and kv is None:  # the state is whole on this rank
            return super().attend_latent(query, keys, own, tp_group, kv)
        from longstraw_mcore.parallel.cp_dsa import attend_latent_sharded

        return attend_latent_sharded(query, keys, own, tp_group, kv, self.layout, self._cp_chunk())


class _ChunkBase(_Base):
    """A prompt chunk [s0, s1): under CP this rank's pieces of it."""

    def __init__(self, state: PromptState, chunk: int, layout: CPLayout | None):
        self.span = state.chunk_bounds[chunk]
        super().__init__(state, self.span[0], layout)
        self.chunk, self.local_span = chunk, state.local_bounds[chunk]
        self.T = self.span[1] - self.span[0]

    def _cp_chunk(self) -> tuple[int, int] | None:
        return None if self.layout is None else (self.T, self.span[0])

    def positions(self, T: int, device) -> torch.Tensor:
        if self.layout is None:
            return super().positions(T, device)
        pos = local_positions(self.T, self.layout.size, self.layout.rank)
        assert len(pos) == T, (len(pos), T)
        return torch.tensor(pos, dtype=torch.long, device=device) + self.span[0]

    def attend(self, q, keys: list[KeySet], q_start: int, block: int, kv=None):
        if self.layout is None:
            return super().attend(q, keys, q_start, block, kv)
        from longstraw_mcore.parallel.cp_attention import chunk_attention

        *prior, own = keys  # this rank's shard of the earlier chunks (maybe none), its pieces of this one
        if kv is not None:  # KV groups with context parallelism
            from longstraw_mcore.parallel.kv_group import group_cp_attention

            return group_cp_attention(q, prior, [own], q_start, kv, self.layout, (self.T, self.span[0]), block)
        return chunk_attention(q, own.k, own.v, prior[0] if prior else None, self.span[0], self.T, self.layout,
                               block=block)

    def recurrent(self, n: int, core, inputs: tuple, n_k_heads: int, conv_width: int):
        if self.layout is None:
            return super().recurrent(n, core, inputs, n_k_heads, conv_width)
        from longstraw_mcore.parallel.cp import gdn_by_heads
        from longstraw_mcore.parallel.cp_comm import HeadsToSeq, SeqToHeads

        L = self.layout
        if not gdn_by_heads(n_k_heads, L.size, self.state.layers[n].gdn_cp):  # by pieces: parallel/cp_gdn.py
            from longstraw_mcore.parallel.cp_gdn import sequence_recurrent

            out, conv, rec = sequence_recurrent(core, inputs, self.read(n), L, self.T, n_k_heads, conv_width)
            self.write(n, GDNState(conv=conv, recurrent=rec))
            return out
        h = n_k_heads // L.size
        whole = [SeqToHeads.apply(x, L, self.T) for x in inputs]
        out, new = core(*whole, heads=(L.rank * h, (L.rank + 1) * h), state=self.read(n))
        self.write(n, new)
        return HeadsToSeq.apply(out, L, self.T)


class CaptureContext(_ChunkBase):
    def __init__(self, state: PromptState, chunk: int, keep_boundaries: bool, layout: CPLayout | None = None):
        super().__init__(state, chunk, layout)
        self.keep_boundaries = keep_boundaries

    def key_sets(self, n: int, k, v):
        return self.state.layers[n].capture_keys(k, v, self.local_span[0], self.span, merged=self.layout is None)

    def read(self, n: int):
        return self.state.layers[n].capture_read(self.chunk, self.keep_boundaries)

    def latent(self, n: int, own):
        if own.ig is None or self.layout is None:
            return self.state.layers[n].capture_latent(own, self.local_span[0])
        from longstraw_mcore.parallel.cp_comm import gather_tokens

        # a pooled indexer (prompt_state/mla_pool.py) pools the whole chunk's raw keys, in order, on every rank
        raw = (gather_tokens(own.ik, self.layout, self.T), gather_tokens(own.ig, self.layout, self.T), self.span[0])
        return self.state.layers[n].capture_latent(own, self.local_span[0], raw)

    def write(self, n: int, new) -> None:
        self.state.layers[n].capture_write(new)


class ReplayContext(_Base):
    """A branch (or a batch of `batch` branches) starting at position `state.length`, or with `path`
    (prompt_state/segments.py) after the shared segments on it: their keys, latents and GDN state
    join the prompt's, replicated like the branch's own (counted once under context parallelism)."""

    def __init__(self, state: PromptState, batch: int = 1, store_probs: bool = False, layout: CPLayout | None = None,
                 path=None):
        self.path = path if path is not None and path.stack else None
        super().__init__(state, state.length + (self.path.tokens if self.path is not None else 0), layout)
        self.batch, self.store_probs = batch, store_probs  # store_probs: the engine checked they fit
        self._shared = 1  # the key sets counted once (replicated): the path's and the call's own
        self._own: dict = {}  # id(a call's own latents) -> with the path's before them

    def key_sets(self, n: int, k, v):
        sets = self.state.layers[n].replay_keys(k, v, self.state.length, self.store_probs)
        if self.path is None:
            return sets
        *prompt, _ = sets
        path = self.path.key_sets(n, k.dtype)
        self._shared = len(path) + 1
        return prompt + path + [KeySet(k, v, self.position_offset)]

    def attend(self, q, keys: list[KeySet], q_start: int, block: int, kv=None):
        if self.layout is None:
            return super().attend(q, keys, q_start, block, kv)
        from longstraw_mcore.parallel.cp_attention import replay_attention

        n = self._shared  # the kinds put the branch's own keys last; the path's sets before them
        if kv is not None:  # KV groups with context parallelism
            from longstraw_mcore.parallel.kv_group import group_cp_attention

            return group_cp_attention(q, keys[:-n], keys[-n:], q_start, kv, self.layout, None, block)
        return replay_attention(q, keys[:-n], keys[-n:], q_start, self.layout, block=block)

    def read(self, n: int):
        seg = self.path.gdn(n) if self.path is not None else None
        if seg is None:
            return self.state.layers[n].replay_read(self.batch)
        conv = seg.conv.to(self.state.layers[n].dtype)
        if self.batch == 1:
            return GDNState(conv=conv, recurrent=seg.recurrent)
        return GDNState(conv=conv.expand(self.batch, -1, -1), recurrent=seg.recurrent.expand(self.batch, -1, -1, -1))

    def latent(self, n: int, own):
        if self.path is not None:
            ext = self.path.latents(n, own)
            self._own[id(own)] = ext
            own = ext
        if self.layout is None:
            return self.state.layers[n].replay_latent(own)
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as copy_to

        # the branch's own latents are replicated and counted on rank 0 only: their gradient (rank 0's)
        # is summed over the ranks so that every replica holds it (parallel/cp_dsa.py)
        g = self.layout.group
        own = dataclasses.replace(own, c=copy_to(own.c, group=g), pe=copy_to(own.pe, group=g))
        return self.state.layers[n].replay_latent(own, own_counted=self.layout.rank == 0)

    def attend_latent(self, query, keys, own, tp_group, kv=None):
        # the rows replicated on every rank (a TP group's stripes count them once) are the path's and the own
        return super().attend_latent(query, keys, self._own.pop(id(own), own), tp_group, kv)

    def write(self, n: int, new) -> None:
        pass  # the branch's own state is scratch of its graph


class SegmentContext(ReplayContext):
    """A shared segment of a prefix tree (replay/tree.py): replayed as a branch is, below `path`,
    while recording what its layers produce into `segment` (its children's prefix state)."""

    def __init__(self, state: PromptState, path, segment, layout: CPLayout | None = None):
        super().__init__(state, 1, False, layout, path)
        self.segment = segment
        assert segment.start == self.position_offset, (segment.start, self.position_offset)

    def key_sets(self, n: int, k, v):
        self.segment.produced.setdefault(n, (k, v))  # (memory.recompute=layer calls again: keep the first)
        return super().key_sets(n, k, v)

    def latent(self, n: int, own):
        self.segment.produced.setdefault(n, own)
        return super().latent(n, own)

    def write(self, n: int, new) -> None:
        self.segment.produced.setdefault(n, new)


class RecomputeContext(_ChunkBase):
    def __init__(self, state: PromptState, chunk: int, layout: CPLayout | None = None):
        super().__init__(state, chunk, layout)
        self.deposit_scale = 1.0 / (layout.size if layout is not None else 1)

    def key_sets(self, n: int, k, v):
        return self.state.layers[n].recompute_keys(k, v, self.chunk, self.local_span, self.span, self.deposit_scale)

    def read(self, n: int):
        return self.state.layers[n].recompute_read(self.chunk, self.deposit_scale)

    def latent(self, n: int, own):
        return self.state.layers[n].recompute_latent(own, self.chunk, self.local_span, self.deposit_scale)

    def write(self, n: int, new) -> None:
        self.state.layers[n].recompute_write(self.chunk, new)


class KeptCaptureContext(RecomputeContext):
    """A capture chunk run with autograd whose graph the sweep back-propagates instead of recomputing
    it (replay.keep_prompt_graph_mib; one rank, no pipeline, context parallelism, KV groups or state
    staging: replay/steps.py `kept_chunks`). Attention: the chunk's K/V stored (detached) and its keys
    handed out as the recompute's, the earlier chunks' with their gradient accumulators as sinks (made
    now rather than at enable_grad). Gated DeltaNet: the entering state recorded as the chunk's
    boundary, read through leaves; the leaving one stored detached and recorded as the output."""

    def __init__(self, state: PromptState, chunk: int):
        super().__init__(state, chunk, None)

    def key_sets(self, n: int, k, v):
        st = self.state.layers[n]
        st.capture_keys(k.detach(), v.detach(), self.local_span[0], self.span)
        st.enable_grad()
        return st.recompute_keys(k, v, self.chunk, self.local_span, self.span)

    def read(self, n: int):
        self.state.layers[n].capture_read(self.chunk, True)
        return self.state.layers[n].recompute_read(self.chunk)

    def write(self, n: int, new) -> None:
        self.state.layers[n].capture_write(GDNState(conv=new.conv.detach(), recurrent=new.recurrent.detach()))
        self.state.layers[n].recompute_write(self.chunk, new)

    def latent(self, n: int, own):
        raise AssertionError("MLA layers are captured without a kept graph (replay/steps.py kept_chunks)")
