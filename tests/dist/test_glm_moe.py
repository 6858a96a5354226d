"""GLM-5.2's MoE block on Megatron's MoELayer (models/glm_moe.py) equals `transformers`'
`GlmMoeDsaMoE`, at expert parallel size 1 and 2 (2 gloo ranks, alltoall dispatcher), float64.

The same weights go into both (router, score-correction bias, 8 routed SwiGLU experts, the shared
expert; under EP=2 each rank holds 4 of the experts) and the same 12 tokens run on both ranks;
compared: the layer output and the gradients of the input, the router weight, this rank's experts
(an expert serves every EP rank's tokens, so under EP=2 its gradient is that of both ranks' copies:
2x the reference's) and the shared expert. Both run with their float32 upcasts lifted to float64 (both routers compute
the sigmoid scores in float32; lifted, the comparison measures the implementations; Megatron's
router logits in float64, router_dtype="fp64"): <= 1e-12 relative. Without the lift the output
still agrees to float32 rounding (<= 1e-5). The bias steers which experts are chosen (a control with a zero bias picks a
different set for some token), never the weights; the router and the bias get no gradient from it.
"""

from __future__ import annotations

import contextlib

import torch
from layout_compare import rel

from longstraw_mcore.launch_local import run_ranks

D64 = torch.float64
E, K, H, I = 8, 3, 16, 12


def _hf():
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

    cfg = M.GlmMoeDsaConfig(vocab_size=64, hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
                            q_lora_rank=8, kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2,
                            index_n_heads=1, index_head_dim=4, num_hidden_layers=4, intermediate_size=16,
                            moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1,
                            routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True)
    torch.manual_seed(5)
    moe = M.GlmMoeDsaMoE(cfg).to(D64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.randn(E, dtype=torch.float32).double() * 0.2)
    return moe


def _megatron(ep: int):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from longstraw_mcore import cpu_compat
    from longstraw_mcore.models.glm_moe import moe_config_kwargs, moe_layer_builder

    cpu_compat.enable("cpu")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    cfg = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=16, num_attention_heads=2,
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            params_dtype=D64, expert_model_parallel_size=ep, hidden_dropout=0.0,
                            **cpu_compat.cpu_config_overrides(),
                            **moe_config_kwargs(E, K, I, 1, 2.5, router_dtype="fp64"))
    return moe_layer_builder(E)(config=cfg, layer_number=1, pg_collection=pgs), pgs.ep


def _load(layer, moe, ep_rank: int, local: int):
    with torch.no_grad():
        layer.router.weight.copy_(moe.gate.weight)
        layer.router.expert_bias.copy_(moe.gate.e_score_correction_bias.float())
        for j, ex in enumerate(layer.experts.local_experts):
            ex.linear_fc1.weight.copy_(moe.experts.gate_up_proj[ep_rank * local + j])
            ex.linear_fc2.weight.copy_(moe.experts.down_proj[ep_rank * local + j])
        sh = moe.shared_experts
        layer.shared_experts.linear_fc1.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        layer.shared_experts.linear_fc2.weight.copy_(sh.down_proj.weight)


def _run(layer, moe, x, gy, lifted: bool):
    """Forward (lifted or not) and backward of both."""
    from hf_reference import LiftFloat32ToFloat64

    lift = LiftFloat32ToFloat64 if lifted else contextlib.nullcontext
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with lift():
        ref = moe(xs[0])
        out = layer(xs[1].transpose(0, 1).contiguous())[0].transpose(0, 1)
    if gy is not None:
        (ref * gy).sum().backward()
        (out * gy).sum().backward()
    return ref.detach(), out.detach(), xs



def _worker(rank, world_size):
    out = {}
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, H, generator=gen, dtype=D64)
    for ep in (1, 2):
        moe = _hf()
        layer, ep_group = _megatron(ep)
        local = E // ep
        _load(layer, moe, ep_group.rank(), local)
        assert len(layer.experts.local_experts) == local
        gy = torch.randn(x.shape, generator=gen, dtype=D64)
        ref, got, xs = _run(layer, moe, x, gy, lifted=True)
        lo = ep_group.rank() * local
        errs = {"output": rel(got, ref), "input grad": rel(xs[1].grad, xs[0].grad),
                "router grad": rel(layer.router.weight.grad, moe.gate.weight.grad)}
        for j, ex in enumerate(layer.experts.local_experts):
            if moe.experts.gate_up_proj.grad[lo + j].abs().max() > 0:  # experts no token chose have none
                # an expert serves the tokens of every EP rank: here ep copies of the same tokens
                errs[f"expert {lo + j} fc1 grad"] = rel(ex.linear_fc1.weight.grad,
                                                         ep * moe.experts.gate_up_proj.grad[lo + j])
                errs[f"expert {lo + j} fc2 grad"] = rel(ex.linear_fc2.weight.grad, ep * moe.experts.down_proj.grad[lo + j])
        sh = moe.shared_experts
        errs["shared fc1 grad"] = rel(layer.shared_experts.linear_fc1.weight.grad,
                                       torch.cat([sh.gate_proj.weight.grad, sh.up_proj.weight.grad]))
        raw_ref, raw_got, _ = _run(layer, moe, x, None, lifted=False)
        out[ep] = dict(worst=max(errs.values()), which=max(errs, key=errs.get), n=len(errs),
                       raw=rel(raw_got, raw_ref),
                       bias_grad=layer.router.expert_bias.grad is None)
    # control: the bias changes the choice for some token (so the test sees it steer)
    with torch.no_grad():
        moe = _hf()
        _, _, with_bias = moe.gate(x)
        moe.gate.e_score_correction_bias.zero_()
        _, _, without = moe.gate(x)
    out["bias_steers"] = not torch.equal(with_bias.sort(-1).values, without.sort(-1).values)
    return out


def test_megatron_moe_equals_transformers_glm_moe_ep1_ep2():
    for rank, out in enumerate(run_ranks(_worker, 2, timeout_s=600)):
        for ep in (1, 2):
            r = out[ep]
            if rank == 0:
                print(f"EP={ep}: {r['n']} tensors, worst rel {r['worst']:.1e} ({r['which']}); float32 router, not "
                      f"lifted: output rel {r['raw']:.1e}")
            assert r["worst"] <= 1e-12 and r["raw"] <= 1e-5 and r["bias_grad"], (ep, r)
        assert out["bias_steers"]
