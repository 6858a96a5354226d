"""DeepSeek Sparse Attention over MLA latents (GLM-5.2), plain torch: the reference path.

Shapes (package legend): B batch, T queries, S keys, H attention heads, Hi indexer heads, Di indexer
head dim, R kv_lora_rank (the latent), Dn / Dr / Dv the no-RoPE / RoPE / value head dims, k the top-k.

    indexer_scores   I[t, s] = sum_h w[t, h] ReLU(q[t, h] . key[s]) Di^-0.5 over the keys a query sees
                     (s at or before it), -inf elsewhere; in >= float32
    indexer_topk     the same over key blocks with a running best k (memory O(queries x (k + block))),
                     the selection in `topk_over_blocks` (the Triton kernel's too)
    select_topk      the k best keys per query with a deterministic tie-break: a higher score first,
                     among equal scores the earlier position. `torch.topk`'s order among ties depends on
                     the tensor's shape, and the indexer's ReLU makes exact-zero scores common, so
                     without it the selection (and its gradient) would change with the layout or the
                     sequence length. Slots beyond a query's visible keys are marked invalid.
    mla_sparse       attention of the queries to their selected keys in absorbed form: the per-head
                     key/value up-projections (kv_b_proj: W_UK [H, Dn, R], W_UV [H, Dv, R]) are folded
                     into the query and the output, so only the latent c_kv [B, S, R] and the shared
                     RoPE key k_pe [B, S, Dr] are read: the expanded per-head K/V of the prompt (what a
                     Hugging Face cache builds, H (Dn + Dr + Dv) / (R + Dr) times larger: 57x for GLM-5.2,
                     64 x 512 / 576) never exists.

The selection is not differentiable (the indexer gets no policy gradient, as in the reference
implementation); mla_sparse is, through plain autograd.

Keys in two parts: every key tensor (`key`, `c_kv`, `k_pe`) may come as a pair (head [1 or B, S0, D], tail
[B, S1, D]): rows [0, S0) and [S0, S0 + S1), the prompt state and the call's own rows as the prompt state
hands them over (prompt_state/mla.py). The twins join them (`joined_rows`: the copy the kernels avoid,
ops/dsa_triton_*.py); a head of batch 1 serves every row of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def joined_rows(x):
    """A key tensor, or a (head, tail) pair of its rows (module docstring), as one tensor [B, S0 + S1, D]."""
    if not isinstance(x, tuple):
        return x
    head, tail = x
    B = max(head.shape[0], tail.shape[0])
    return torch.cat([head.expand(B, *head.shape[1:]), tail.to(head.dtype).expand(B, *tail.shape[1:])], 1)


def rows_count(x) -> int:
    """The key rows of a key tensor or a (head, tail) pair."""
    return x[0].shape[1] + x[1].shape[1] if isinstance(x, tuple) else x.shape[1]


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last dim of x [B, T, (H,) Dr] in interleaved pairs (x0, x1), (x2, x3), ... (one
    frequency per pair) and return it de-interleaved, [rotated evens | rotated odds], as DeepSeek/GLM
    checkpoints lay it out; queries and keys both take this layout, so their dot products are the
    interleaved rotation's."""
    d = x.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=work, device=x.device) / d))
    ang = positions.to(work)[:, None] * inv_freq[None, :]                       # [T, Dr/2]
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (d // 2,)
    cos, sin = ang.cos().to(x.dtype).view(shape), ang.sin().to(x.dtype).view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def indexer_scores(q: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hi, Di], key [B, S, Di], weights [B, T, Hi] (already scaled), positions [T] / [S] ->
    scores [B, T, S] (float32, float64 for float64 inputs); keys after a query are -inf."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.einsum("bthd,bsd->bths", q.to(work), key.to(work)) * q.shape[-1] ** -0.5
    scores = torch.einsum("bth,bths->bts", weights.to(work), F.relu(s))
    visible = k_pos[None, :] <= q_pos[:, None]
    return scores.masked_fill(~visible[None], float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, T, S] -> (indices [B, T, min(k, S)] long, valid [B, T, min(k, S)] bool): the best keys
    first, equal scores broken toward the earlier position (a stable sort of the negated scores keeps
    the positions' order among ties); -inf (invisible) keys are never valid."""
    if k < 1:
        raise ValueError(f"index_topk={k}: must be >= 1")
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :min(k, scores.shape[-1])]
    valid = torch.gather(scores, -1, order) > float("-inf")
    return order, valid


def indexer_topk(q: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor,
                 k_pos: torch.Tensor, k: int, block: int = 4096,
                 counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_topk(indexer_scores(...))` over key blocks of `block` rows: (rows [B, T, k'] into `key`,
    their scores, -inf where invalid). Scores exist for one block at a time plus the running best k, so
    memory is O(T (k + block)) rather than O(T S) (a 2M-token prompt has 2M keys per query). `counted`
    [S] bool: only those keys may be chosen (context parallelism: parallel/cp_dsa.py)."""
    key = joined_rows(key)
    return topk_over_blocks(lambda a, b: indexer_scores(q, key[:, a:b], weights, q_pos, k_pos[a:b]),
                            key.shape[1], k, block, counted)


def topk_over_blocks(scores_of, S: int, k: int, block: int, counted: torch.Tensor | None = None):
    """The best k of S keys per query from their scores one key block at a time: `scores_of(a, b)` gives
    the scores [B, T, b - a] of rows [a, b) (-inf where invisible). The keys are in position order, so the
    running best (ties already in position order) followed by the next block (later positions) and
    `select_topk`'s stable sort give exactly the single-pass selection. Shared by the twin and the
    Triton kernel (ops/dsa_triton_indexer.py: its fused scores), so their selections differ only where
    their scores do."""
    best_rows = best_vals = None
    for a in range(0, S, block):
        b = min(S, a + block)
        sc = scores_of(a, b)
        if counted is not None:
            sc = sc.masked_fill(~counted[a:b], float("-inf"))
        rows = torch.arange(a, b, device=sc.device).expand(*sc.shape[:2], b - a)
        if best_vals is not None:
            sc, rows = torch.cat([best_vals, sc], -1), torch.cat([best_rows, rows], -1)
        order, _ = select_topk(sc, k)
        best_vals, best_rows = torch.gather(sc, -1, order), torch.gather(rows, -1, order)
    return best_rows, best_vals


def _selected_logits(q_nope, q_pe, c_kv, k_pe, w_uk, idx, valid, scale):
    """(logits [B, T, H, k] of every query to its selected keys, in >= float32, -inf where not valid;
    the selected latents [B, T, k, R])."""
    work = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    B, T, k = idx.shape
    q_abs = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)                      # query in latent space
    flat = idx.reshape(B, T * k)
    c_sel = torch.gather(c_kv, 1, flat[..., None].expand(-1, -1, c_kv.shape[-1])).view(B, T, k, -1)
    pe_sel = torch.gather(k_pe, 1, flat[..., None].expand(-1, -1, k_pe.shape[-1])).view(B, T, k, -1)
    logits = (torch.einsum("bthr,btkr->bthk", q_abs, c_sel)
              + torch.einsum("bthd,btkd->bthk", q_pe, pe_sel)).to(work) * scale
    return logits.masked_fill(~valid[:, :, None, :], float("-inf")), c_sel


def by_query_blocks(fn, block: int, per_query: tuple, shared: tuple):
    """`fn(*per_query, *shared)` with the per-query tensors ([B, T, ...]) split into blocks of `block`
    queries along dim 1 and the results concatenated there. Under autograd each block runs in
    torch.utils.checkpoint: it keeps its inputs only and gathers its selected latents again in its
    backward (memory.mla_query_block: activations O(block x top-k), not O(T x top-k)). `block` 0, or
    one block: a plain call. Each query's result depends only on its own row, so blocks change no number."""
    T = per_query[0].shape[1]
    if block <= 0 or block >= T:
        return fn(*per_query, *shared)
    from torch.utils.checkpoint import checkpoint

    parts = []
    for s in range(0, T, block):
        piece = tuple(x[:, s:s + block] for x in per_query)
        parts.append(checkpoint(fn, *piece, *shared, use_reentrant=False, early_stop=False) if torch.is_grad_enabled()
                     else fn(*piece, *shared))
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(xs, 1) for xs in zip(*parts))
    return torch.cat(parts, 1)


def mla_sparse(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               w_uk: torch.Tensor, w_uv: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
               scale: float, query_block: int = 0) -> torch.Tensor:
    """q_nope [B, T, H, Dn], q_pe [B, T, H, Dr] (rotated), c_kv [B, S, R], k_pe [B, S, Dr] (rotated),
    w_uk [H, Dn, R], w_uv [H, Dv, R], idx / valid [B, T, k] -> [B, T, H, Dv]. Softmax in >= float32.
    `query_block`: see `by_query_blocks`."""
    c_kv, k_pe = joined_rows(c_kv), joined_rows(k_pe)
    return by_query_blocks(_mla_sparse, query_block, (q_nope, q_pe, idx, valid), (c_kv, k_pe, w_uk, w_uv, scale))


def _mla_sparse(q_nope, q_pe, idx, valid, c_kv, k_pe, w_uk, w_uv, scale):
    logits, c_sel = _selected_logits(q_nope, q_pe, c_kv, k_pe, w_uk, idx, valid, scale)
    p = torch.softmax(logits, dim=-1).to(c_kv.dtype)
    o_lat = torch.einsum("bthk,btkr->bthr", p, c_sel)                          # attention output, latent
    return torch.einsum("bthr,hvr->bthv", o_lat, w_uv)


def mla_sparse_partial(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                       w_uk: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                       scale: float, query_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_sparse` over a part of the keys, before the value up-projection: (o_lat [B, T, H, R], the
    softmax-weighted latents over this part's valid keys; lse [B, T, H], their log-sum-exp, -inf where a
    query has none here). Parts merge by log-sum-exp (parallel/cp_dsa.py); then o = o_lat W_UV."""
    c_kv, k_pe = joined_rows(c_kv), joined_rows(k_pe)
    return by_query_blocks(_mla_sparse_partial, query_block, (q_nope, q_pe, idx, valid), (c_kv, k_pe, w_uk, scale))


def _mla_sparse_partial(q_nope, q_pe, idx, valid, c_kv, k_pe, w_uk, scale):
    logits, c_sel = _selected_logits(q_nope, q_pe, c_kv, k_pe, w_uk, idx, valid, scale)
    lse = torch.logsumexp(logits, dim=-1)
    none = torch.isinf(lse)
    p = torch.exp(logits - torch.where(none, torch.zeros_like(lse), lse)[..., None]).to(c_kv.dtype)
    return torch.einsum("bthk,btkr->bthr", p, c_sel), lse
