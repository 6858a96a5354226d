"""The pooled DeepSeek Sparse Attention indexer of GLM-5.3-Flash (transformers' `Glm5NextTextIndexer`), plain torch.

Shapes (package legend, ops/dsa.py): B batch, T queries, S keys (tokens), Hi indexer heads, Di indexer head
dim, kpool the pool size (`index_kpool`), P pools, n the pools chosen per query (index_topk // kpool).

The indexer scores pools of kpool tokens, not tokens: pool j holds the tokens at absolute positions
[kpool j, kpool j + kpool) (pools are aligned to position 0, whatever the chunking of the calls), and its key
is a gated per-channel average of its tokens' keys. A query chooses the n best pools it sees, sees all their
tokens, and always sees the tokens of its own incomplete pool up to itself (the "tail").

    pool_keys         k, g [B, S, Di] (the tokens' raw indexer keys k_norm(wk(x)) and gate scores
                      x @ compress_gate^T) of positions start .. start + S - 1 (start a multiple of kpool),
                      ape [kpool, Di] -> (pooled [B, S // kpool, Di] in k's dtype, ends [S // kpool] long: each
                      complete pool's last absolute position). pooled[j, d] = sum_i softmax_i(g[i, d] +
                      ape[i, d]) k[i, d] over the pool's tokens i; the softmax in >= float32, its
                      probabilities cast to k's dtype before the weighted sum, as transformers does. The
                      S % kpool tokens after the last complete pool are not pooled: the caller keeps them
                      raw (a later call, or the prompt state, completes that pool).
    pooled_topk       q [B, T, Hi, Di], weights [B, T, Hi] (weights_proj(x) Hi^-0.5), q_pos [T], pooled
                      [B, P, Di] (or a (head, tail) pair of its rows, ops/dsa.py), ends [P] -> (rows [B, T, n'],
                      valid [B, T, n']) with n' = min(n, P): ops/dsa.indexer_topk over the pooled keys at key
                      positions `ends`. That is transformers' rule exactly: a pool is a candidate for query t
                      iff it is complete and its last token is <= t; score = sum_h w[t, h] ReLU(q[t, h] . pool
                      Di^-0.5); the n best, ties toward the earlier pool (transformers' `torch.topk` orders
                      ties its own way: the two agree wherever the n-th and (n+1)-th scores differ).
    expand_selection  rows, valid [B, T, n'], ends [P], q_pos [T] -> (positions [B, T, n' kpool + kpool - 1]
                      long, valid bool; positions -1 where not valid): each chosen pool's kpool tokens
                      ends[row] - kpool + 1 .. ends[row], then the query's tail kpool floor((t + 1) / kpool) + i
                      for i < (t + 1) % kpool (empty when t closes a pool: that pool is then a candidate like
                      any other, so a query at the end of a pool sees itself only if its pool is chosen).
    pooled_selection  the three for one call whose keys are its own tokens from position 0.
    pooled_positions  the selection among given complete pools (a prompt state's and a call's) as global
                      positions; pools_from: the complete pools of raw keys from a pool boundary; rows_of: global
                      positions as rows of a key set (one rank's whole keys).

What the attention sees is the SET of valid positions (the order is not transformers'). transformers returns
int32 indices of width index_topk + kpool - 1, padded with -1 whatever the number of pools; ours are long, of
width n' kpool + kpool - 1 (n' = min(n, P)), which holds the same set.

Nothing here is differentiable (transformers' indexer runs under torch.no_grad: no gradient reaches wq_b, wk,
k_norm, weights_proj, the gate or ape); every function runs under torch.no_grad.
"""

from __future__ import annotations

import torch

from longstraw_mcore.ops.dsa import indexer_topk, joined_rows, rows_count


def _work_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, float32 otherwise (the softmax's precision)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


@torch.no_grad()
def pool_keys(k: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, kpool: int,
              start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, g [B, S, Di] of positions start .. start + S - 1, ape [kpool, Di] -> (pooled [B, S // kpool, Di],
    ends [S // kpool] long) (module docstring). `start` must be a multiple of kpool (pools are aligned to
    position 0)."""
    if kpool < 1:
        raise ValueError(f"kpool={kpool}: must be >= 1")
    if start < 0 or start % kpool:
        raise ValueError(f"start={start} is not a non-negative multiple of kpool={kpool}: pools are aligned to "
                         "position 0; pool from the first complete pool's start and carry the tokens before it raw")
    if k.shape != g.shape or k.dim() != 3:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)}: expected the same [B, S, Di]")
    B, S, Di = k.shape
    if tuple(ape.shape) != (kpool, Di):
        raise ValueError(f"ape {tuple(ape.shape)}: expected [kpool, Di] = [{kpool}, {Di}]")
    P = S // kpool
    ends = start + kpool * torch.arange(1, P + 1, device=k.device) - 1
    if P == 0:
        return k.new_zeros(B, 0, Di), ends
    work = _work_dtype(g, ape)
    keys = k[:, :P * kpool].reshape(B, P, kpool, Di)
    logits = g[:, :P * kpool].reshape(B, P, kpool, Di).to(work) + ape.to(work)[None, None]
    probs = torch.softmax(logits, dim=2).to(k.dtype)
    return (probs * keys).sum(dim=2), ends


@torch.no_grad()
def pooled_topk(q: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor, pooled, ends: torch.Tensor,
                n_pools: int, block: int = 4096,
                counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `n_pools` pools per query (module docstring) -> (rows [B, T, n'] long into the pools, valid
    [B, T, n'] bool), n' = min(n_pools, P). `pooled` [B, P, Di] or a (head, tail) pair of its rows; `ends` [P]
    the pools' last positions; `block`, `counted` [P] bool: as ops/dsa.indexer_topk (over pools)."""
    if n_pools < 1:
        raise ValueError(f"n_pools={n_pools}: must be >= 1 (index_topk // index_kpool)")
    P = rows_count(pooled)
    if ends.shape != (P,):
        raise ValueError(f"ends {tuple(ends.shape)}: expected one end position per pool, [{P}]")
    B, T = q.shape[:2]
    if P == 0:
        return (torch.empty(B, T, 0, dtype=torch.long, device=q.device),
                torch.zeros(B, T, 0, dtype=torch.bool, device=q.device))
    rows, vals = indexer_topk(q, pooled, weights, q_pos, ends, n_pools, block, counted)
    return rows, vals > float("-inf")


@torch.no_grad()
def expand_selection(rows: torch.Tensor, valid: torch.Tensor, ends: torch.Tensor, kpool: int,
                     q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen pools and each query's tail as token positions: (positions [B, T, n' kpool + kpool - 1] long, -1
    where not valid; valid bool) (module docstring)."""
    B, T, n = rows.shape
    offsets = torch.arange(kpool, device=rows.device)
    if n:
        last = ends[rows.clamp(0, ends.numel() - 1)]                                   # [B, T, n']
        pools = (last[..., None] - (kpool - 1) + offsets).reshape(B, T, n * kpool)
    else:
        pools = rows.new_empty(B, T, 0)
    pools_valid = valid[..., None].expand(B, T, n, kpool).reshape(B, T, n * kpool)
    q_pos = q_pos.to(device=rows.device, dtype=torch.long)
    seen = q_pos + 1                                                                # tokens up to the query
    tail = (seen - seen % kpool)[:, None] + offsets[None, :kpool - 1]                # [T, kpool - 1]
    tail_valid = offsets[None, :kpool - 1] < (seen % kpool)[:, None]
    positions = torch.cat([pools, tail.expand(B, T, kpool - 1)], -1)
    ok = torch.cat([pools_valid, tail_valid.expand(B, T, kpool - 1)], -1)
    return positions.masked_fill(~ok, -1), ok


@torch.no_grad()
def pooled_selection(q: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                     g: torch.Tensor, ape: torch.Tensor, kpool: int, index_topk: int,
                     block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """One call whose keys are its own tokens from position 0 (k, g [B, S, Di]): `pool_keys`, `pooled_topk` of
    index_topk // kpool pools, `expand_selection` -> (positions, valid) [B, T, n' kpool + kpool - 1]."""
    return pooled_positions(q, weights, q_pos, pool_keys(k, g, ape, kpool), kpool, index_topk, block)


@torch.no_grad()
def pooled_positions(q: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor, pools: tuple, kpool: int,
                     index_topk: int, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of queries at `q_pos` among `pools` = (pooled [B, P, Di] or a (head, tail) pair of its rows,
    ends [P]: every complete pool the call may see; later ones are masked by position) as global positions:
    (positions [B, T, w], valid). The same on every rank that holds the same pools (they are replicated)."""
    if index_topk < kpool or index_topk % kpool:
        raise ValueError(f"index_topk={index_topk} is not a positive multiple of index_kpool={kpool}")
    pooled, ends = _up_to(*pools, int(q_pos.max()) if q_pos.numel() else -1)
    rows, valid = pooled_topk(q, weights, q_pos, pooled, ends, index_topk // kpool, block)
    return expand_selection(rows, valid, ends, kpool, q_pos)


def _up_to(pooled, ends: torch.Tensor, last: int):
    """The pools ending at or before position `last` (no later one is a candidate for these queries): a prefix,
    `ends` being ascending; `pooled` may be a (head, tail) pair of rows."""
    n = int((ends <= last).sum())
    if n == ends.numel():
        return pooled, ends
    if isinstance(pooled, tuple):
        head, tail = pooled
        pooled = head[:, :n] if n <= head.shape[1] else (head, tail[:, :n - head.shape[1]])
    else:
        pooled = pooled[:, :n]
    return pooled, ends[:n]


@torch.no_grad()
def pools_from(k, g, pos: torch.Tensor, pooling: tuple) -> tuple:
    """The complete pools of raw keys k, g [B, S, Di] at consecutive positions `pos` starting at a pool boundary,
    `pooling` = (ape, kpool): (pooled, ends), as `pooled_positions` takes them."""
    ape, kpool = pooling
    start = int(pos[0]) if pos.numel() else 0
    if pos.numel() and int(pos[-1]) - start != pos.numel() - 1:
        raise ValueError(f"pooled indexer: key positions {start}..{int(pos[-1])} are not {pos.numel()} consecutive "
                         "positions")
    return pool_keys(joined_rows(k), joined_rows(g), ape, kpool, start)


def rows_of(positions: torch.Tensor, valid: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Global positions [B, T, w] -> rows of a key set whose positions are `key_pos` [S] (0 where not valid; a valid
    position must be among them)."""
    size = int(key_pos.max()) + 1 if key_pos.numel() else 1
    lookup = torch.full((size + 1,), -1, dtype=torch.long, device=key_pos.device)
    lookup[key_pos] = torch.arange(key_pos.numel(), device=key_pos.device)
    rows = lookup[positions.clamp(0, size)]
    if bool((valid & (rows < 0)).any()):
        raise RuntimeError("pooled indexer: a selected position is not among the keys (the pools and the key rows "
                           "disagree)")
    return rows.clamp(min=0)


def pooled_selection_of(query, keys):
    """A pooled indexer's selection for an MLA layer's `query` (prompt_state/hooks.py LatentQuery: its indexer
    queries and weights, positions, `pool` = (ape, kpool), top-k, block) over `keys` (MLAKeys: their `pools`, or
    the complete pools of their raw `ik`, `ig`): (global positions [B, T, w], valid), the same on every rank that
    sees the same pools."""
    qi, wi = query.index
    pools = keys.pools if keys.pools is not None else pools_from(keys.ik, keys.ig, keys.pos, query.pool)
    return pooled_positions(qi, wi, query.pos, pools, query.pool[1], query.topk, query.block)
