"""DeepSeek Sparse Attention over MLA latents (ops/dsa.py), float64.

1. Against an independent naive reference on tie-heavy inputs (indexer scores with many exact zeros
   and repeated values): per query, the visible keys sorted in Python by (score descending, position
   ascending), the top k kept, the per-head keys and values expanded from the latent (what a Hugging
   Face cache holds) and a plain softmax. Output and the gradients of every differentiable input
   <= 1e-12. Also: the selection is the same for a query whatever the sequence length around it
   (a prefix run selects what the full run selects for the prefix's queries).
2. Against `transformers`' `GlmMoeDsaAttention` (its float32 upcasts lifted to float64), with our
   ops fed its weights: the dense regime (index_topk >= length) and the sparse regime on inputs whose
   k-th and (k+1)-th indexer scores differ for every query (no tie for `torch.topk` to order its own
   way, checked): the layer output and the gradients of the input and every attention weight
   <= 1e-12 relative. The indexer gets no gradient on either side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw_mcore.ops.dsa import indexer_scores, indexer_topk, mla_sparse, rope_interleaved, select_topk

D64 = torch.float64


def _naive(q_nope, q_pe, c, k_pe, w_uk, w_uv, scores, k, scale):
    B, S, H, _ = q_nope.shape
    out = torch.zeros(B, S, H, w_uv.shape[1], dtype=D64)
    for b in range(B):
        for s in range(S):
            vis = [t for t in range(scores.shape[2]) if scores[b, s, t] > float("-inf")]
            chosen = sorted(vis, key=lambda t: (-float(scores[b, s, t]), t))[:k]
            for h in range(H):
                keys = torch.stack([torch.cat([w_uk[h] @ c[b, t], k_pe[b, t]]) for t in chosen])
                vals = torch.stack([w_uv[h] @ c[b, t] for t in chosen])
                p = torch.softmax(keys @ torch.cat([q_nope[b, s, h], q_pe[b, s, h]]) * scale, 0)
                out[b, s, h] = p @ vals
    return out


def test_sparse_mla_equals_naive_reference_on_ties():
    g = torch.Generator().manual_seed(3)
    B, S, H, Hi, Di, Dn, Dr, Dv, R, k = 2, 11, 3, 2, 4, 5, 4, 6, 7, 4

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=D64)

    q_nope, q_pe, c, k_pe = r(B, S, H, Dn), r(B, S, H, Dr), r(B, S, R), r(B, S, Dr)
    w_uk, w_uv = r(H, Dn, R), r(H, Dv, R)
    # indexer inputs with ties: integer-valued keys repeat, half the heads' products are negative -> ReLU 0
    qi = torch.randint(-1, 2, (B, S, Hi, Di), generator=g).to(D64)
    ki = torch.randint(-1, 2, (B, S, Di), generator=g).to(D64)
    w = torch.ones(B, S, Hi, dtype=D64)
    pos = torch.arange(S)
    scores = indexer_scores(qi, ki, w, pos, pos)
    ties = sum(int((row[row > float("-inf")].unique().numel() < (row > float("-inf")).sum()))
               for row in scores.view(-1, S))
    assert ties >= S, ties  # the inputs really are tie-heavy
    idx, valid = select_topk(scores, k)
    leaves = [t.clone().requires_grad_(True) for t in (q_nope, q_pe, c, k_pe, w_uk, w_uv)]
    out = mla_sparse(*leaves, idx, valid, (Dn + Dr) ** -0.5)
    ref_leaves = [t.clone().requires_grad_(True) for t in (q_nope, q_pe, c, k_pe, w_uk, w_uv)]
    ref = _naive(*ref_leaves, scores, k, (Dn + Dr) ** -0.5)
    gy = r(*out.shape)
    grads = torch.autograd.grad((out * gy).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * gy).sum(), ref_leaves)
    err = max([float((out - ref).abs().max())] + [float((a - b).abs().max()) for a, b in zip(grads, ref_grads)])
    print(f"sparse MLA vs naive (ties in {ties} of {B * S} queries): worst abs {err:.1e}")
    assert err <= 1e-12
    # the selection of a query does not depend on how many queries or keys follow it
    pre = select_topk(indexer_scores(qi[:, :7], ki[:, :7], w[:, :7], pos[:7], pos[:7]), k)
    assert torch.equal(pre[0][pre[1]], idx[:, :7, :][valid[:, :7]])
    assert not valid[:, 0, 1:].any() and valid[:, k - 1:].all()
    # blockwise scores with a running top-k choose exactly the same keys, in the same order, whatever
    # the block; and with some keys not counted (context parallelism) the best of the others
    vals = torch.gather(scores, -1, idx)
    for block in (1, 3, 7, S):
        rows, bvals = indexer_topk(qi, ki, w, pos, pos, k, block)
        assert torch.equal(rows[valid], idx[valid]) and torch.equal(bvals, vals), block
    counted = torch.arange(S) % 3 != 1
    rows, bvals = indexer_topk(qi, ki, w, pos, pos, k, 4, counted)
    want, wvalid = select_topk(scores.masked_fill(~counted, float("-inf")), k)
    assert torch.equal(rows[wvalid], want[wvalid]) and torch.equal(bvals > float("-inf"), wvalid)


def _hf_attention(seed: int, topk: int, seq: int):
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

    cfg = M.GlmMoeDsaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                            q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
                            index_n_heads=3, index_head_dim=8, index_topk=topk, num_hidden_layers=1,
                            intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
                            num_experts_per_tok=2, rope_theta=10000.0, attention_bias=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = M.GlmMoeDsaAttention(cfg, 0).to(D64)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() == 1:  # norm weights start at ones / zeros: move them
                p.add_(0.1 * torch.randn_like(p))
    rope = M.GlmMoeDsaRotaryEmbedding(cfg).to(D64)
    x = torch.randn(2, seq, 32, dtype=D64)
    return cfg, attn, rope, x


def _ours(attn, cfg, x):
    """The layer through ops/dsa.py from the HF module's weights (latent form, no expanded K/V)."""
    B, S, _ = x.shape
    H, Dn, Dr, Dv, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
        cfg.kv_lora_rank
    pos = torch.arange(S)
    theta = cfg.rope_parameters["rope_theta"]

    def rms(t, norm):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight

    q_resid = rms(F.linear(x, attn.q_a_proj.weight), attn.q_a_layernorm)
    q = F.linear(q_resid, attn.q_b_proj.weight).view(B, S, H, Dn + Dr)
    q_nope, q_pe = q.split([Dn, Dr], -1)
    kv = F.linear(x, attn.kv_a_proj_with_mqa.weight)
    c = rms(kv[..., :R], attn.kv_a_layernorm)
    k_pe = rope_interleaved(kv[..., R:], pos, theta)
    q_pe = rope_interleaved(q_pe, pos, theta)
    w = attn.kv_b_proj.weight.view(H, Dn + Dv, R)
    ix = attn.indexer
    with torch.no_grad():
        qi = F.linear(q_resid, ix.wq_b.weight).view(B, S, ix.n_heads, ix.head_dim)
        qi = torch.cat([rope_interleaved(qi[..., :Dr], pos, theta), qi[..., Dr:]], -1)
        ki = ix.k_norm(F.linear(x, ix.wk.weight))
        ki = torch.cat([rope_interleaved(ki[..., :Dr], pos, theta), ki[..., Dr:]], -1)
        wts = F.linear(x, ix.weights_proj.weight) * ix.n_heads ** -0.5
        scores = indexer_scores(qi, ki, wts, pos, pos)
        idx, valid = select_topk(scores, ix.index_topk)
    o = mla_sparse(q_nope, q_pe, c, k_pe, w[:, :Dn], w[:, Dn:], idx, valid, attn.scaling)
    return F.linear(o.reshape(B, S, H * Dv), attn.o_proj.weight), scores


def test_equals_transformers_glm_moe_dsa_attention():
    from hf_reference import LiftFloat32ToFloat64

    for name, seed, topk, seq in (("dense", 0, 16, 9), ("sparse", 1, 4, 13)):
        with LiftFloat32ToFloat64():
            cfg, attn, rope, x = _hf_attention(seed, topk, seq)
            x.requires_grad_(True)
            pos = torch.arange(seq)[None]
            cos_sin = rope(x, pos)
            mask = torch.full((seq, seq), torch.finfo(D64).min, dtype=D64).triu(1)[None, None].expand(2, 1, -1, -1)
            ref = attn(x, cos_sin, mask.contiguous())[0]
        params = [p for n, p in attn.named_parameters() if not n.startswith("indexer.")]
        gy = torch.randn_like(ref)
        ref_grads = torch.autograd.grad((ref * gy).sum(), [x] + params)
        out, scores = _ours(attn, cfg, x)
        if name == "sparse":  # no tie at the k-th score of any query that has more than k visible keys
            top = torch.sort(scores, -1, descending=True).values
            many = (scores > float("-inf")).sum(-1) > topk
            assert many.any() and bool((top[..., topk - 1] > top[..., topk])[many].all())
        grads = torch.autograd.grad((out * gy).sum(), [x] + params)
        err = max([float((out - ref).abs().max() / ref.abs().max())]
                  + [float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) for a, b in zip(grads, ref_grads)])
        print(f"GLM-5.2 DSA attention ({name}, topk {topk}, {seq} tokens) vs transformers: worst rel {err:.1e}")
        assert err <= 1e-12, (name, err)
        assert all(p.grad is None for p in attn.indexer.parameters())


def test_glm_5_2_state_bytes_per_position():
    """GLM-5.2 in bf16 keeps 95,232 B per prompt position (../shared/notes/architectures.md): the MLA
    latent + RoPE key (512 + 64) on all 78 layers and the 128-dim indexer key on its 21 full layers."""
    from longstraw_mcore.config import glm_5_2
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.families import get_family

    m = glm_5_2()
    assert m.indexer_types.count("full") == 21 and m.mlp_types.count("moe") == 75
    per = analytic_state_bytes(get_family(m.family).layers, m, 1, 1)
    assert per == {"mla_latent": 78 * 576 * 2, "dsa_index_keys": 21 * 128 * 2}
    assert sum(per.values()) == 95_232
    total = sum(analytic_state_bytes(get_family(m.family).layers, m, 1, 2**21).values())
    print(f"GLM-5.2 prompt state at 2^21 positions: {total / 2**30:.1f} GiB ({total / 32 / 2**30:.2f} GiB per rank "
          "over 32 sequence shards)")
    assert round(total / 2**30) == 186


def test_glm_bad_input_is_refused_with_the_value():
    """Before any allocation: top-k <= 0, an EP size that does not divide the experts, a layout the
    family does not run yet, a checkpoint missing an expert or a tensor."""
    import pytest

    from longstraw_mcore.checkpoint.common import CheckpointError
    from longstraw_mcore.checkpoint.glm_dsa import hf_shapes, hf_to_mcore
    from longstraw_mcore.config import ConfigError, ParallelConfig
    from longstraw_mcore.config import glm_5_2

    with pytest.raises(ConfigError, match=r"model.index_topk=0: must be a positive integer"):
        glm_5_2(index_topk=0)
    m = glm_5_2()
    with pytest.raises(ConfigError, match=r"n_routed_experts=256 is not divisible by parallel.ep=3; .*\[1, 2, 4"):
        m.check_layout(ParallelConfig(ep=3))
    with pytest.raises(ConfigError, match=r"parallel.pp_layers=\[39, 39\]: stage\(s\) would start at layer\(s\) \[39\]"):
        m.check_layout(ParallelConfig(pp=2))  # layer 39 reuses layer 38's top-k: a stage cannot start there
    m.check_layout(ParallelConfig(pp=2, pp_layers=[38, 40], cp=2, tp=2))
    m.check_layout(ParallelConfig(ep=8))
    tiny = glm_5_2(num_layers=2, indexer_types=["full", "shared"], first_k_dense_replace=1, n_routed_experts=4,
                   num_experts_per_tok=2, hidden_size=4, intermediate_size=4, moe_intermediate_size=2, vocab_size=8)
    hf = {k: torch.zeros(s) for k, s in hf_shapes(tiny).items()}
    hf_to_mcore(hf, tiny)  # complete: converts
    gone = {k: hf.pop(k) for k in [k for k in hf if ".mlp.experts.3." in k]}  # one expert missing
    assert len(gone) == 3
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.mlp.experts.3.down_proj.weight', "
                                              r"'model.layers.1.mlp.experts.3.gate_proj.weight'"):
        hf_to_mcore(hf, tiny)
    hf.update(gone)
    hf["model.layers.1.mlp.gate.weight"] = torch.zeros(3, 4)  # a router for three experts
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.mlp.gate.weight has shape \(3, 4\), expected "
                                              r"\(4, 4\)"):
        hf_to_mcore(hf, tiny)
