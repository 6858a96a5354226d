"""The GLM-5.x model on Megatron-Core (models/glm5.py: MLA + DSA with IndexShare, dense and MoE layers)
equals `transformers`' `GlmMoeDsaForCausalLM`, float64, TP=1, one gloo rank.

A 4-layer tiny config: layer 0 dense, layers 1-3 MoE (6 experts, top 2, a shared expert); 8
indexer heads (few exact-zero scores); indexer schedule [full, full, shared, full] (index_topk_freq 2, offset 2). The dense regime (index_topk >=
length) and the sparse regime (index_topk 4 of 13 tokens) on inputs where no full layer has a tie
at its k-th indexer score (checked on our side: `torch.topk` orders ties its own way, ours breaks
them toward the earlier position). Both run with their float32 upcasts lifted to float64 (Megatron's
router takes the sigmoid in float32; lifted, the comparison measures the implementations): logits and
every parameter gradient <= 1e-10 relative. Weights go through checkpoint/glm_dsa.py's name table and
load_full (the HF MTP layer is skipped and counted); the indexer and the router bias get no gradient.
"""

from __future__ import annotations

import torch
from layout_compare import rel

from longstraw_mcore.launch_local import run_ranks

D64 = torch.float64


def _configs(topk: int, first_dense: int = 1, layers: int = 4):
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

    from longstraw_mcore.config import GlmDsaConfig

    types = GlmDsaConfig.index_share_schedule(layers, 2, 2)
    assert types == ["full", "full", "shared", "full", "shared", "full"][:layers]
    kw = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_attention_heads=4, q_lora_rank=16,
              kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, index_n_heads=8,
              index_head_dim=8, index_topk=topk, first_k_dense_replace=first_dense, n_routed_experts=6,
              num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=10, routed_scaling_factor=2.5,
              rope_theta=10000.0, rms_norm_eps=1e-5)
    hf = M.GlmMoeDsaConfig(**{k: v for k, v in kw.items() if k != "rms_norm_eps"}, rms_norm_eps=1e-5,
                           num_hidden_layers=layers, num_key_value_heads=4, indexer_types=types, n_group=1, topk_group=1,
                           norm_topk_prob=True, tie_word_embeddings=False, attention_bias=False)
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64)
    ours = GlmDsaConfig(**kw, num_layers=layers, indexer_types=types, dtype="float64")
    return hf, ours


def _hf_model(cfg, seed):
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

    torch.manual_seed(seed)
    model = M.GlmMoeDsaForCausalLM(cfg).to(D64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif "experts" in n:
                p.normal_(0, 0.2)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):  # MoE layers
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(6).float().double() * 0.1)
    return model


def build_glm(m, tp: int = 1, ep: int = 1, build=None):
    """(our GLM model, its layout) on freshly initialised Megatron groups of this world; `build`: a family's
    build_model (GLM-5.2's by default)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from longstraw_mcore import cpu_compat
    from longstraw_mcore.families.glm_dsa import build_model

    cpu_compat.enable("cpu")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    par = SimpleNamespace(tp=tp, pp=1, cp=1, ep=ep, pgs=pgs, is_first_stage=True, is_last_stage=True,
                          dp=dist.get_world_size() // tp, pp_rank=0, stage_layers=[m.num_layers], tp_kv=None, vpp=1,
                          virtual_layers=None)
    return (build or build_model)(m, par, "cpu"), par



def _worker(rank, world_size):
    from hf_reference import LiftFloat32ToFloat64, hf_grads, recorded_topk_gaps

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.glm_dsa import from_transformers_state, hf_to_mcore, skipped_names

    out = {}
    for name, topk, seq, seed in (("dense", 32, 12, 0), ("sparse", 4, 13, 4)):
        hf_cfg, m = _configs(topk)
        with LiftFloat32ToFloat64():  # built under it too: RoPE's inverse frequencies are made at construction
            hf = _hf_model(hf_cfg, seed)
        model = build_glm(m)[0]
        state = {n: t for n, t in hf.state_dict().items()}
        state["model.layers.4.eh_proj.weight"] = torch.zeros(1)  # an MTP tensor: skipped, counted
        tensors, skipped = hf_to_mcore(from_transformers_state(state), m), skipped_names(state, m)
        load_full(model, tensors)
        ids = torch.randint(0, m.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed + 9))
        with recorded_topk_gaps() as gaps, LiftFloat32ToFloat64():
            ref = hf(ids).logits
            got = model(ids)[..., :m.vocab_size]
        gy = torch.randn(ref.shape, dtype=D64, generator=torch.Generator().manual_seed(seed + 1))
        (ref * gy).sum().backward()
        (got * gy).sum().backward()
        want = hf_to_mcore(from_transformers_state(hf_grads(hf)), m)
        own = gather_full(model, grads=True)
        errs = {"logits": rel(got.detach(), ref.detach())}
        for n, g in want.items():
            if n.endswith("expert_bias") or ".indexer." in n:
                continue
            if g.abs().max() > 0:
                errs[n] = rel(own[n], g)
        no_grad = all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
        out[name] = dict(worst=max(errs.values()), which=max(errs, key=errs.get), n=len(errs), skipped=skipped,
                         min_gap=min(gaps) if gaps else None, indexer_no_grad=no_grad)
    return out


def test_glm_dsa_model_equals_transformers():
    out = run_ranks(_worker, 1, timeout_s=600)[0]
    for name, r in out.items():
        print(f"GLM-5.x {name}: logits and {r['n'] - 1} gradients vs transformers, worst rel {r['worst']:.1e} "
              f"({r['which']}); smallest k-th/(k+1)-th indexer score gap {r['min_gap']}")
        assert r["worst"] <= 1e-10, (name, r)
        assert r["skipped"] == ["model.layers.4.eh_proj.weight"] and r["indexer_no_grad"]
    assert out["sparse"]["min_gap"] is not None and out["sparse"]["min_gap"] > 1e-6, out["sparse"]
