"""The pooled DSA indexer selection (ops/dsa_pool.py) equals transformers' GLM-5.3-Flash `Glm5NextTextIndexer`
(its torch binding: bench/hf_kernels.py `glm5_next_modeling(fla=False)`) in float64, its float32 casts lifted
(tests/hf_reference.py `LiftFloat32ToFloat64`). The indexer's constant initialisations (ape and compress gate
zeros, k_norm weight ones / bias zeros) are replaced by random values, so a swapped or ignored tensor cannot pass.

- Pool keys against transformers' `get_pooled_states`: <= 1e-12 relative, the same end positions; pooling a
  suffix from a later pool boundary (start > 0) gives the whole sequence's pools it covers; a start that is
  not a multiple of kpool is refused; bfloat16 keys pool as transformers pools them (bit for bit).
- The selection against transformers' `forward` (no cache, no padding), B = 2, kpool 4 (and 1): per query the
  SET of valid selected token positions is equal, for S = 13 and 18 (not multiples of kpool: an incomplete
  last pool), S = 16, S = 3 (< kpool: no pool at all, the tail only), with index_topk // kpool below and above
  the number of pools. transformers' `torch.topk` orders ties its own way and ours breaks them toward the
  earlier pool, so wherever a query sees more pools than it may choose, the gap between its n-th and
  (n+1)-th pool scores (ours) is checked to be > 1e-6: the inputs (seeds) are chosen so that it holds, and
  the sets are then decided by the scores alone. A query that closes a pool ((t + 1) % kpool == 0) has no
  tail and sees its own token only if its pool is chosen: some do not (checked), on both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from layout_compare import rel as _rel

from longstraw_mcore.bench.hf_kernels import glm5_next_modeling
from longstraw_mcore.ops.dsa import indexer_scores
from longstraw_mcore.ops.dsa_pool import expand_selection, pool_keys, pooled_selection, pooled_topk

F64 = torch.float64
B, H, HI, DI, QL = 2, 32, 4, 8, 16


def _indexer(kpool: int, index_topk: int, seed: int):
    from hf_reference import LiftFloat32ToFloat64

    hf = glm5_next_modeling(fla=False)
    gen = torch.Generator().manual_seed(seed)
    with LiftFloat32ToFloat64():
        cfg = hf.Glm5NextTextConfig(hidden_size=H, index_n_heads=HI, index_head_dim=DI, index_kpool=kpool,
                                    index_topk=index_topk, q_lora_rank=QL)
        idx = hf.Glm5NextTextIndexer(cfg, 3).to(F64)
    with torch.no_grad():
        for name, p in idx.named_parameters():
            if name == "k_norm.weight":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=F64))
    return idx


def _projections(idx, x, q_resid):
    """Our inputs from the indexer's weights: q [B, S, Hi, Di], k and g [B, S, Di], weights [B, S, Hi]."""
    with torch.no_grad():
        q = idx.wq_b(q_resid).view(*x.shape[:2], HI, DI)
        k = idx.k_norm(idx.wk(x))
        g = F.linear(x, idx.index_kpool_compress_gate)
        w = idx.weights_proj(x) * HI ** -0.5
    return q, k, g, w


def _hf_forward(idx, x, q_resid):
    from hf_reference import LiftFloat32ToFloat64

    with LiftFloat32ToFloat64():
        return idx(x, q_resid, attention_mask=torch.ones(x.shape[:2], dtype=torch.bool), past_key_values=None)


def _sets(positions, valid):
    out = {}
    for b in range(positions.shape[0]):
        for t in range(positions.shape[1]):
            chosen = [int(p) for p, ok in zip(positions[b, t], valid[b, t]) if ok]
            assert len(chosen) == len(set(chosen)), (b, t, chosen)  # no position twice
            out[b, t] = set(chosen)
    return out


def _min_gap(q, w, pooled, ends, n):
    """The smallest gap between the n-th and (n+1)-th visible pool scores over the queries seeing > n pools
    (inf if none does), and how many queries that is."""
    S = q.shape[1]
    scores = indexer_scores(q, pooled, w, torch.arange(S), ends)
    gap, counted = float("inf"), 0
    for row in scores.flatten(0, 1):
        vis = row[row > float("-inf")].sort(descending=True).values
        if vis.numel() > n:
            gap, counted = min(gap, float(vis[n - 1] - vis[n])), counted + 1
    return gap, counted


@pytest.mark.parametrize("kpool,index_topk,seed,lengths", [
    (4, 8, 0, (13, 18, 16, 3)),   # 2 pools per query: fewer than the 3-4 pools of 13-18 tokens
    (4, 32, 1, (13, 18, 3)),      # 8 pools per query: more than there are, every visible pool chosen
    (1, 3, 2, (7,)),              # a pool per token, no tail: token-level DSA
])
def test_selection_equals_transformers(kpool, index_topk, seed, lengths):
    idx = _indexer(kpool, index_topk, seed)
    n = index_topk // kpool
    gen = torch.Generator().manual_seed(100 + seed)
    above = blind = 0
    for S in lengths:
        x = torch.randn(B, S, H, generator=gen, dtype=F64)
        q_resid = torch.randn(B, S, QL, generator=gen, dtype=F64)
        want = _hf_forward(idx, x, q_resid)
        assert want.dtype == torch.int32 and want.shape == (B, S, index_topk + kpool - 1), (want.dtype, want.shape)
        q, k, g, w = _projections(idx, x, q_resid)
        pos = torch.arange(S)
        got, ok = pooled_selection(q, w, pos, k, g, idx.index_kpool_compress_ape, kpool, index_topk)
        P = S // kpool
        assert got.dtype == torch.long and got.shape == (B, S, min(n, P) * kpool + kpool - 1), (S, got.shape)
        causal = got <= pos[None, :, None]
        assert bool((got[~ok] == -1).all()) and bool((got[ok] >= 0).all()) and bool(causal[ok].all())
        pooled, ends = pool_keys(k, g, idx.index_kpool_compress_ape, kpool)
        gap, counted = _min_gap(q, w, pooled, ends, n)
        assert gap > 1e-6, (S, gap)  # no near-tie at the boundary of the chosen pools: the sets are well defined
        above += counted
        mine = _sets(got, ok)
        theirs = _sets(want, want >= 0)
        bad = [(bt, sorted(mine[bt]), sorted(theirs[bt])) for bt in mine if mine[bt] != theirs[bt]]
        assert not bad, (S, bad[:3])
        for t in range(S):  # every query sees exactly min(n, visible pools) pools and its tail
            tail = (t + 1) % kpool
            vis_pools = (t + 1) // kpool
            assert len(mine[0, t]) == min(n, vis_pools) * kpool + tail, (S, t, sorted(mine[0, t]))
        blind += sum(t not in mine[b, t] for b in range(B) for t in range(S))
    if n < max(lengths) // kpool:
        assert above > 0  # the top-k really chose among more pools than it could take
        # a query that closes its pool has no tail: it sees its own token only if its pool is chosen (here not
        # always: transformers' mask need not hold the diagonal)
        assert blind > 0, blind


def test_pool_keys_equal_transformers_and_suffixes():
    from hf_reference import LiftFloat32ToFloat64

    kpool, S = 4, 18
    idx = _indexer(kpool, 8, 5)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, H, generator=gen, dtype=F64)
    _, k, g, _ = _projections(idx, x, torch.zeros(B, S, QL, dtype=F64))
    ape = idx.index_kpool_compress_ape.detach()
    pooled, ends = pool_keys(k, g, ape, kpool)
    with LiftFloat32ToFloat64(), torch.no_grad():
        ref, ref_idx, ref_valid = idx.get_pooled_states(torch.cat([k, g, torch.ones(B, S, 1, dtype=F64)], -1))
    assert pooled.shape == (B, 4, DI) and pooled.dtype == F64 and bool(ref_valid.all())
    assert _rel(pooled, ref) <= 1e-12, _rel(pooled, ref)
    assert ends.tolist() == [3, 7, 11, 15] and torch.equal(ref_idx[..., -1], ends.expand(B, -1))
    # a suffix from a pool boundary pools as the whole sequence does; its incomplete remainder is left out
    for start in (4, 8, 16):
        part, part_ends = pool_keys(k[:, start:], g[:, start:], ape, kpool, start=start)
        j = start // kpool
        assert part.shape == (B, 4 - j, DI) and torch.equal(part_ends, ends[j:]), (start, part.shape)
        assert torch.equal(part, pooled[:, j:]), start
    with pytest.raises(ValueError, match=r"start=6 .*kpool=4"):
        pool_keys(k[:, 6:], g[:, 6:], ape, kpool, start=6)
    assert pool_keys(k[:, :3], g[:, :3], ape, kpool)[0].shape == (B, 0, DI)  # S < kpool: no pool
    # pooled keys as a (head, tail) pair of rows select as one tensor; the expansion marks what is invalid
    q = torch.randn(B, S, HI, DI, generator=gen, dtype=F64)
    w = torch.randn(B, S, HI, generator=gen, dtype=F64)
    pos = torch.arange(S)
    one = pooled_topk(q, w, pos, pooled, ends, 2)
    two = pooled_topk(q, w, pos, (pooled[:1, :1], pooled[:, 1:]), ends, 2)  # a batch-1 head serves every row
    head_b = pooled_topk(q[:1], w[:1], pos, pooled[:1], ends, 2)
    assert torch.equal(head_b[0], two[0][:1]) and torch.equal(head_b[1], two[1][:1])
    two_full = pooled_topk(q, w, pos, (pooled[:, :1], pooled[:, 1:]), ends, 2)
    assert torch.equal(one[0], two_full[0]) and torch.equal(one[1], two_full[1])
    positions, ok = expand_selection(*one, ends, kpool, pos)
    assert positions.shape == (B, S, 2 * kpool + kpool - 1)
    assert positions[0, 2].tolist() == [-1] * 8 + [0, 1, 2] and ok[0, 2].tolist() == [False] * 8 + [True] * 3
    assert sorted(positions[1, 3].tolist()) == [-1] * 7 + [0, 1, 2, 3]  # t = 3 closes pool 0: no tail

    # bfloat16: the softmax in float32, its probabilities cast to bfloat16 before the sum, as transformers
    kb, gb = k.to(torch.bfloat16), g.to(torch.bfloat16)
    idx_b = _indexer(kpool, 8, 5).to(torch.bfloat16)
    with torch.no_grad():
        ref_b = idx_b.get_pooled_states(torch.cat([kb, gb, torch.ones(B, S, 1, dtype=torch.bfloat16)], -1))[0]
    got_b = pool_keys(kb, gb, idx_b.index_kpool_compress_ape, kpool)[0]
    assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, ref_b)
