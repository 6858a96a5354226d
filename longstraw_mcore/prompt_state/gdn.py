"""Prompt state of a Gated DeltaNet layer: the conv window and the recurrent state after the prompt
(and, in exact mode, the state entering every capture chunk, which that chunk's recompute needs).

Legend: Ch local conv channels (q, k, v), W conv width, Hv local value heads, Dk/Dv head dims.

    capture   read the state entering the chunk (None at the start; exact mode records it as the
              chunk's boundary), write the state leaving it, copied into storage of its own size (the
              conv window is a view into the chunk's padded input; kept as a view it would pin it)
    replay    every branch starts from the final state (expanded over a batch of branches); a
              branch's own updates are scratch of its graph, never written back
    exact     the final state becomes autograd leaves in float32 (the conv window is cast; float64
              stays float64) whose gradients accumulate over branches; chunk c's recompute starts from
              fresh leaves of its boundary and is seeded with the gradient carried from chunk c+1
Bytes per layer: (W-1) Ch in the model dtype + Hv Dk Dv in the state dtype; exact mode adds one such
state per capture chunk after the first.
"""

from __future__ import annotations

import torch

from longstraw_mcore.prompt_state.base import LayerState, element_size, grad_dtype, own_storage
from longstraw_mcore.prompt_state.hooks import GDNState


def _leaves(st: GDNState) -> GDNState:
    """Autograd leaves over `st` (the conv window in float32 so its gradient accumulates there)."""
    conv = st.conv.detach().to(grad_dtype(st.conv.dtype))  # the same storage when already >= float32
    return GDNState(conv=conv.requires_grad_(True), recurrent=st.recurrent.detach().requires_grad_(True))


def _split_conv(conv: torch.Tensor, channels: tuple[int, int, int], parts: int) -> list[torch.Tensor]:
    """A head shard's conv window [B, Ch/parts, W-1], laid out q | k | v -> its [q, k, v] pieces."""
    return list(torch.split(conv, [c // parts for c in channels], 1))


def _gather_heads(st: GDNState, layout, channels) -> GDNState:
    """Head shards of every CP rank -> the whole state (conv channels reassembled as q | k | v)."""
    import torch.distributed as dist

    convs = [torch.empty_like(st.conv) for _ in range(layout.size)]
    recs = [torch.empty_like(st.recurrent) for _ in range(layout.size)]
    dist.all_gather(convs, st.conv.contiguous(), group=layout.group)
    dist.all_gather(recs, st.recurrent.contiguous(), group=layout.group)
    pieces = [_split_conv(c, channels, layout.size) for c in convs]
    conv = torch.cat([torch.cat([p[i] for p in pieces], 1) for i in range(3)], 1)
    return GDNState(conv=conv, recurrent=torch.cat(recs, 1))


def _own_heads(st: GDNState, layout, channels) -> GDNState:
    """The whole state -> this CP rank's head shard (the inverse of `_gather_heads`)."""
    n, r = layout.size, layout.rank
    q, k, v = torch.split(st.conv, list(channels), 1)
    conv = torch.cat([x.chunk(n, 1)[r] for x in (q, k, v)], 1)
    return GDNState(conv=conv.contiguous(), recurrent=st.recurrent.chunk(n, 1)[r].contiguous())


def _grads_or_zeros(leaf: GDNState) -> GDNState:
    return GDNState(conv=leaf.conv.grad if leaf.conv.grad is not None else torch.zeros_like(leaf.conv),
                    recurrent=leaf.recurrent.grad if leaf.recurrent.grad is not None else torch.zeros_like(leaf.recurrent))


class GDNRecurrentState(LayerState):
    kind = "gdn_state"

    def __init__(self, m, tp: int, captured: int, device, batch: int = 1, **_):
        self.dtype = m.torch_dtype
        hk = m.linear_num_key_heads // tp
        self.channels = (hk * m.linear_key_head_dim, hk * m.linear_key_head_dim,
                         (m.linear_num_value_heads // tp) * m.linear_value_head_dim)   # conv window: q | k | v
        self.hk, self.gdn_cp = hk, m.gdn_cp
        self.layout = None                       # context parallel: capture states are head shards (by heads)
        self.deposit_scale = 1.0
        self.current: GDNState | None = None     # after the positions captured so far
        self.boundaries: list = []               # exact mode: the state entering chunk c (None for c = 0)
        self.leaves: GDNState | None = None      # exact mode: leaves over `current` during replay
        # exact mode, per chunk in flight (a pipeline recomputes chunk c-1 before chunk c's backward):
        self.entry: dict = {}                    # chunk -> leaves of the state entering it (None for 0)
        self.produced: dict = {}                 # chunk -> the state its recompute leaves

    # --- capture -----------------------------------------------------------------------------------
    def capture_read(self, chunk: int, keep_boundary: bool) -> GDNState | None:
        if keep_boundary:
            assert len(self.boundaries) == chunk, (len(self.boundaries), chunk)
            self.boundaries.append(self.current)
        return self.current

    def capture_write(self, new: GDNState) -> None:
        self.current = GDNState(conv=own_storage(new.conv), recurrent=own_storage(new.recurrent))

    def _by_heads(self) -> bool:
        """Context parallel by head shards (else by sequence pieces: whole states on every rank)."""
        from longstraw_mcore.parallel.cp import gdn_by_heads

        return self.layout is not None and gdn_by_heads(self.hk, self.layout.size, self.gdn_cp)

    def finish_capture(self, layout) -> None:
        """Context parallel by heads: the capture ran on this rank's 1/n of the heads; every rank gets
        the whole final state (replay runs all heads on every rank). The chunk boundaries stay head
        shards. By sequence pieces (parallel/cp_gdn.py) every state is already whole."""
        self.layout = layout
        if self._by_heads() and self.current is not None:
            self.current = _gather_heads(self.current, layout, self.channels)

    # --- replay ------------------------------------------------------------------------------------
    def replay_read(self, batch: int) -> GDNState | None:
        st = self.leaves if self.leaves is not None else self.current
        if st is None:
            return None
        conv = st.conv.to(self.dtype)
        if batch == 1:
            return GDNState(conv=conv, recurrent=st.recurrent)
        return GDNState(conv=conv.expand(batch, -1, -1), recurrent=st.recurrent.expand(batch, -1, -1, -1))

    # --- exact mode --------------------------------------------------------------------------------
    def enable_grad(self) -> None:
        self.leaves = None if self.current is None else _leaves(self.current)

    def release_grad(self) -> None:
        self.leaves, self.entry, self.produced = None, {}, {}

    def recompute_read(self, chunk: int, deposit_scale: float = 1.0) -> GDNState | None:
        self.deposit_scale = deposit_scale
        entering = self.boundaries[chunk]
        if chunk not in self.entry:  # a second call (memory.recompute=layer) reads the same leaves
            self.entry[chunk] = None if entering is None else _leaves(entering)
        e = self.entry[chunk]
        return None if e is None else GDNState(conv=e.conv.to(self.dtype), recurrent=e.recurrent)

    def recompute_write(self, chunk: int, new: GDNState) -> None:
        self.produced.setdefault(chunk, new)  # a recompute's second call keeps the first (attention_kv.py)

    def outputs(self, chunk: int) -> list[torch.Tensor]:
        assert chunk in self.produced, f"the recompute of chunk {chunk} did not reach this layer"
        return [self.produced[chunk].conv, self.produced[chunk].recurrent]

    def seed_grads(self, chunk: int) -> list[torch.Tensor]:
        """The gradient of the state chunk `chunk` leaves: the replays' (last chunk) or what chunk
        c+1's recompute deposited into its entering leaves, scaled as its seeds were (context
        parallel: see contexts.py). Complete once those backwards ran on this stage."""
        last = chunk == len(self.boundaries) - 1
        carried = _grads_or_zeros(self.leaves if last else self.entry[chunk + 1])
        if self.layout is not None and not self._by_heads():
            # by sequence pieces the states are replicated: the entering state's gradient is partial
            # per rank (summed here), and the leaving state is seeded at 1/n per rank, since every
            # rank's scan adds to the pieces it gathered (parallel/cp_gdn.py)
            n = self.layout.size
            if not last:
                from longstraw_mcore.parallel.cp_comm import all_reduce_sum

                carried = GDNState(conv=all_reduce_sum(carried.conv.clone(), self.layout),
                                   recurrent=all_reduce_sum(carried.recurrent.clone(), self.layout))
            scale = (1.0 if last else self.deposit_scale) / n
            return [carried.conv * scale, carried.recurrent * scale]
        if last:
            if self.layout is not None:
                carried = _own_heads(carried, self.layout, self.channels)
            return [carried.conv, carried.recurrent]
        if self.deposit_scale != 1.0:
            carried = GDNState(conv=carried.conv * self.deposit_scale, recurrent=carried.recurrent * self.deposit_scale)
        return [carried.conv, carried.recurrent]

    def finish_chunk(self, chunk: int) -> None:
        self.produced.pop(chunk, None)
        self.entry.pop(chunk + 1, None)  # its gradient is now in chunk c's seeds

    # --- memory ------------------------------------------------------------------------------------
    def kept(self):
        cur = [] if self.current is None else [self.current.conv, self.current.recurrent]
        bnd = [t for b in self.boundaries if b is not None for t in (b.conv, b.recurrent)]
        return {"gdn_state": cur, "gdn_chunk_boundaries": bnd}

    def grad_tensors(self):
        out = []
        for st in [self.leaves, *self.entry.values()]:
            if st is not None:
                out += [st.conv, st.recurrent]
                out += [t.grad for t in (st.conv, st.recurrent) if t.grad is not None]
        return out

    @staticmethod
    def _elements(m, tp: int) -> tuple[int, int]:
        """(conv window, recurrent state) elements of one layer on one TP rank."""
        ch = (2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim) // tp
        return ((m.linear_conv_kernel_dim - 1) * ch,
                (m.linear_num_value_heads // tp) * m.linear_key_head_dim * m.linear_value_head_dim)

    @classmethod
    def analytic_bytes(cls, m, tp: int, captured: int, exact_chunks: int, batch: int = 1, cp: int = 1) -> dict[str, int]:
        """The final state is whole on every rank; under context parallelism by heads the chunk
        boundaries are head shards (1/cp each), by sequence pieces whole."""
        from longstraw_mcore.parallel.cp import gdn_by_heads

        conv, rec = cls._elements(m, tp)
        per = (conv * element_size(m.torch_dtype) + rec * element_size(m.state_dtype)) * batch
        shards = cp if gdn_by_heads(m.linear_num_key_heads // tp, cp, m.gdn_cp) else 1
        return {"gdn_state": per if captured > 0 else 0,
                "gdn_chunk_boundaries": per // shards * max(exact_chunks - 1, 0)}

    @classmethod
    def analytic_grad_bytes(cls, m, tp: int, captured: int) -> int:
        """During replay: the gradients of the final state's leaves (>= float32), plus the float32 copy
        of the conv window when the model dtype is narrower."""
        if captured == 0:
            return 0
        conv, rec = cls._elements(m, tp)
        copies = conv if grad_dtype(m.torch_dtype) != m.torch_dtype else 0
        return (conv + rec + copies) * element_size(grad_dtype(m.torch_dtype))

