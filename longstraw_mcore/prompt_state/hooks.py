"""The mixer-facing prompt-state protocol: every hook a mixer may call on the context it runs under.

A model runs with a context passed through Megatron's `inference_context` slot; it is the only way
branch-replay concerns reach layer code, one hook per mixer type. `StateHooks` declares every hook
with its single-rank, stateless behaviour (a plain forward: a mixer given no context uses
`NO_STATE`); the contexts of prompt_state/contexts.py (capture, replay, exact mode's recompute, under
context and tensor parallelism) override them, and `StateContext` below keeps earlier state in a dict
(tests, simple use). Layer numbers are Megatron's global 1-based ones.

    every mixer     positions(T, device)                   absolute positions of the call's T tokens
    attention       key_sets(layer, k, v) -> [KeySet]      the key sets its queries attend to (earlier
                                                           positions and its own), given the K/V of its
                                                           own positions (the context keeps what it must)
                    attend(q, key_sets, q_start, block, kv)  the attention over them (`kv`: the layer's KV
                                                           group when TP exceeds the KV heads)
    Gated DeltaNet  recurrent(layer, core, inputs, hk, W)  the mixer's sequence core (conv of width W +
                                                           delta rule over a head range, from an entering
                                                           state to a leaving one) on the call's tokens; by
                                                           default through read(layer) -> state entering
                                                           the call (None: start of sequence) and
                                                           write(layer, state)
    MLA + DSA       latent(layer, own) -> MLAKeys          the latents its queries may see, given its own (a
                                                           pooled indexer's keys: raw, pooled where selected)
                    attend_latent(query, keys, own, tp, kv)  the sparse attention over them: (out, selection)

Shapes (package legend; local to the TP rank): attention k/v `[B, S, Hk, D]` after k-norm and RoPE;
GDN conv window `[B, Ch, W-1]` (Ch = local q, k, v channels in that order), recurrent `[B, Hv, Dk, Dv]`
in >= float32; MLA latent `[B, S, R]`, RoPE key `[B, S, Dr]`, indexer key `[B, S, Di]`.
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


@dataclass
class MLAKeys:
    """What a call's queries may attend to: latents, RoPE keys, indexer keys (None on shared layers),
    and the keys' absolute positions."""

    c: torch.Tensor            # [B, S, R], or a (head, tail) pair of its rows (ops/dsa.py: state, own)
    pe: torch.Tensor           # [B, S, Dr], likewise
    ik: torch.Tensor | None    # [B, S, Di], likewise
    pos: torch.Tensor          # [S] global positions
    counted: torch.Tensor | None = None  # [S] bool: rows this rank counts when the state is sharded (None: all)
    # A pooled indexer (GLM-5.3-Flash, ops/dsa_pool.py): a call's own keys carry `ik` and the gate scores `ig` raw
    # [B, S, Di] and `pooling` = (ape [kpool, Di], kpool); keys handed back by a prompt state carry `pools` = (pooled,
    # ends): every complete pool the call's queries may see (None: pool the raw `ik`, `ig` of the keys here)
    ig: torch.Tensor | None = None
    pooling: tuple | None = None
    pools: tuple | None = None


@dataclass
class LatentQuery:
    """An MLA + DSA layer's queries, as its attention over the latents needs them (this TP rank's h heads)."""

    q_nope: torch.Tensor       # [B, T, h, Dn]
    q_pe: torch.Tensor         # [B, T, h, Dr], rotated
    w_uk: torch.Tensor         # [h, Dn, R] (kv_b_proj's key rows: absorbed into the query)
    w_uv: torch.Tensor         # [h, Dv, R] (its value rows: applied to the latent-space output)
    pos: torch.Tensor          # [T] the queries' positions
    scale: float
    topk: int
    block: int                 # indexer key block (memory O(T (topk + block)))
    index: tuple | None = None      # full layer: the indexer's (queries [B, T, Hi, Di], weights [B, T, Hi]), no grad
    selection: tuple | None = None  # shared layer: the previous full layer's (keys [B, T, k], valid [B, T, k])
    query_block: int = 0            # memory.mla_query_block: queries per block whose selection is recomputed
    pool: tuple | None = None       # full layer of a pooled indexer: (ape [kpool, Di], kpool) (ops/dsa_pool.py)


class StateHooks:
    """Every hook a mixer may call, with the single-rank, stateless answers (see the module docstring)."""

    position_offset: int = 0

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(self.position_offset, self.position_offset + T, device=device)

    def key_sets(self, layer_number: int, k: torch.Tensor, v: torch.Tensor) -> list[KeySet]:
        return [KeySet(k, v, self.position_offset)]

    def attend(self, q: torch.Tensor, keys: list[KeySet], q_start: int, block: int, kv=None):
        """`kv`: the layer's KV group when tp exceeds the KV heads (parallel/kv_group.py)."""
        if kv is not None:
            from longstraw_mcore.parallel.kv_group import group_attention

            return group_attention(q, [k for k in keys if k.local], [k for k in keys if not k.local], q_start, kv,
                                   block=block)
        return attention(q, keys, q_start, block=block)

    def read(self, layer_number: int):
        return None

    def write(self, layer_number: int, state) -> None:
        pass

    def recurrent(self, layer_number: int, core, inputs: tuple, n_k_heads: int, conv_width: int):
        out, new = core(*inputs, heads=(0, n_k_heads), state=self.read(layer_number))
        self.write(layer_number, new)
        return out

    def latent(self, layer_number: int, own: MLAKeys) -> MLAKeys:
        return own

    def attend_latent(self, query: LatentQuery, keys: MLAKeys, own: MLAKeys, tp_group, kv=None):
        """The queries over every latent in `keys` (replicated on the TP ranks, whose heads all read them:
        their gradient sums over TP) -> (out [B, T, h, Dv], the selection: rows of `keys`, valid)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as copy_to

        from longstraw_mcore.ops.dispatch import dsa_kernel

        selection = query.selection
        if query.index is not None and query.pool is not None:
            from longstraw_mcore.ops.dsa_pool import pooled_selection_of, rows_of

            positions, ok = pooled_selection_of(query, keys)
            selection = (rows_of(positions, ok, keys.pos), ok)
        elif query.index is not None:
            qi, wi = query.index
            with torch.no_grad():
                rows, vals = dsa_kernel(qi, "dsa_indexer").indexer_topk(qi, keys.ik, wi, query.pos, keys.pos,
                                                                         query.topk, query.block)
            selection = (rows, vals > float("-inf"))
        idx, valid = selection
        def replicated(x):  # a key tensor or its (state, own) parts (ops/dsa.py)
            return tuple(copy_to(t, group=tp_group) for t in x) if isinstance(x, tuple) else copy_to(x, group=tp_group)

        c, k_pe = replicated(keys.c), replicated(keys.pe)
        kernel = dsa_kernel(query.q_nope, "dsa_attention")
        return kernel.mla_sparse(query.q_nope, query.q_pe, c, k_pe, query.w_uk, query.w_uv, idx, valid, query.scale,
                                 query.query_block), selection

    # Megatron's TransformerLayer/Block only query these under CUDA-graph inference; answer plainly.
    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return False


NO_STATE = StateHooks()
"""The hooks of a plain forward (no cached state, one rank's view): what a mixer uses without a context."""


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
