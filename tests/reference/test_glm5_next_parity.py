"""The GLM-5.3-Flash text decoder on Megatron-Core (models/glm5_next.py: KDA and MLA/DSA with pooled indexer keys,
dense and MoE MLPs, hyper-connection streams) equals `transformers`' `Glm5NextForConditionalGeneration` on text,
float64, TP=1, one gloo rank.

A 4-layer tiny config (KDA / MLA full / MLA shared / KDA; dense then MoE of 4 experts, top 2, a shared expert; 4
streams; indexer pools of 4; a 1-block vision tower, skipped and counted on load). The dense regime (index_topk at
least the sequence: every pool selected) over 13 tokens and the sparse regime (index_topk 4: one pool of 4 plus
the query's incomplete pool) over 18, on inputs where no full layer has a tie at its k-th pool score (checked on our
side: `torch.topk` orders ties its own way, ours breaks them toward the earlier pool). Both run with their float32
upcasts lifted to float64: logits and every parameter gradient <= 1e-10 relative. Weights go through
checkpoint/glm5_next.py's table and load_full; the indexer and the router bias get no gradient.

transformers' constant and uninitialised tensors (the streams' base/scale, A_log, dt_bias, the pool gate and
position terms, the norms) are drawn at random, so a wrong mapping or a dropped term cannot pass.
"""

from __future__ import annotations

import torch
from layout_compare import rel

from longstraw_mcore.launch_local import run_ranks

D64 = torch.float64
TYPES = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
INDEXER = ["full", "full", "shared", "full"]
MLP = ["dense", "sparse", "sparse", "sparse"]
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32,
              projection_intermediate_size=40, patch_size=2, spatial_merge_size=2, temporal_patch_size=2, image_size=8)


def _configs(topk: int):
    from longstraw_mcore.bench.hf_kernels import glm5_next_modeling
    from longstraw_mcore.config import Glm5NextConfig

    hf = glm5_next_modeling(fla=False)
    kw = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_attention_heads=4, q_lora_rank=16,
              kv_lora_rank=12, qk_nope_head_dim=6, v_head_dim=5, index_n_heads=4, index_head_dim=8, index_topk=topk,
              index_kpool=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=10,
              routed_scaling_factor=2.5, swiglu_limit=1.5, linear_num_heads=2, linear_head_dim=6,
              linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_sinkhorn_iters=5, rms_norm_eps=1e-5)
    text = dict(kw, num_hidden_layers=4, num_key_value_heads=4, layer_types=TYPES, indexer_types=INDEXER,
                mlp_layer_types=MLP, pad_token_id=None, tie_word_embeddings=False)
    cfg = hf.Glm5NextConfig(text_config=text, vision_config=VISION)
    cfg.text_config._attn_implementation = "eager"
    cfg.text_config._experts_implementation = "eager"
    ours = Glm5NextConfig(**kw, num_layers=4, mixer_types=TYPES, indexer_types=INDEXER, mlp_layer_types=MLP,
                          gdn_chunk_size=8, dtype="float64")
    return hf, cfg, ours


def _hf_model(hf, cfg, seed):
    torch.manual_seed(seed)
    model = hf.Glm5NextForConditionalGeneration(cfg).to(D64)
    gen = torch.Generator().manual_seed(seed + 100)

    def rnd(shape, scale):
        return scale * torch.randn(shape, generator=gen, dtype=D64)

    with torch.no_grad():
        for n, p in model.model.language_model.named_parameters():
            if n.endswith("A_log"):
                p.copy_(rnd(p.shape, 0.3) - 0.7)
            elif n.endswith("dt_bias"):
                p.copy_(rnd(p.shape, 0.3) - 3.0)
            elif n.endswith(".fn"):
                p.copy_(rnd(p.shape, 0.05))
            elif n.endswith(".scale"):
                p.copy_(1.0 + rnd(p.shape, 0.2))
            elif "experts" in n:
                p.copy_(rnd(p.shape, 0.2))
            elif p.dim() == 1 or "kpool" in n or "conv1d" in n:
                p.copy_(p + rnd(p.shape, 0.3) if "norm" in n else rnd(p.shape, 0.3))
        for n, b in model.model.language_model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(rnd(b.shape, 0.1))
    return model


def _worker(rank, world_size):
    from hf_reference import LiftFloat32ToFloat64, hf_grads, recorded_topk_gaps
    from test_glm_parity import build_glm

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.glm5_next import from_transformers_state, hf_to_mcore, skipped_names
    from longstraw_mcore.families.glm5_next import build_model

    out = {}
    for name, topk, seq, seed in (("dense", 32, 13, 0), ("sparse", 4, 18, 4)):
        hf_mod, cfg, m = _configs(topk)
        with LiftFloat32ToFloat64():
            ref_model = _hf_model(hf_mod, cfg, seed)
        model = build_glm(m, build=build_model)[0]
        state = from_transformers_state(ref_model.state_dict())
        tensors, skipped = hf_to_mcore(state, m), skipped_names(state, m)
        load_full(model, tensors)
        ids = torch.randint(0, m.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed + 9))
        with recorded_topk_gaps() as gaps, LiftFloat32ToFloat64():
            ref = ref_model(input_ids=ids).logits
            got = model(ids)[..., :m.vocab_size]
        gy = torch.randn(ref.shape, dtype=D64, generator=torch.Generator().manual_seed(seed + 1))
        (ref * gy).sum().backward()
        (got * gy).sum().backward()
        want = hf_to_mcore(from_transformers_state(hf_grads(ref_model)), m)
        own = gather_full(model, grads=True)
        errs = {"logits": rel(got.detach(), ref.detach())}
        for n, g in want.items():
            if n.endswith("expert_bias") or ".indexer." in n:
                continue
            if g.abs().max() > 0:
                errs[n] = rel(own[n], g)
        no_grad = all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
        out[name] = dict(worst=max(errs.values()), which=max(errs, key=errs.get), n=len(errs),
                         skipped=sum(s.startswith("model.visual.") for s in skipped) == len(skipped) > 0,
                         min_gap=min(gaps) if gaps else None, indexer_no_grad=no_grad, tensors=len(want))
    return out


def test_glm5_next_model_equals_transformers():
    out = run_ranks(_worker, 1, timeout_s=600)[0]
    for name, r in out.items():
        print(f"GLM-5.3-Flash {name}: logits and {r['n'] - 1} of {r['tensors']} gradients vs transformers, worst rel "
              f"{r['worst']:.1e} ({r['which']}); smallest k-th/(k+1)-th pool score gap {r['min_gap']}")
        assert r["worst"] <= 1e-10, (name, r)
        assert r["skipped"] and r["indexer_no_grad"], r
        assert r["n"] > 60, r  # every trained tensor compared (the indexer and router bias aside)
    assert out["sparse"]["min_gap"] is not None and out["sparse"]["min_gap"] > 1e-6, out["sparse"]
