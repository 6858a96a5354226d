"""The Kimi Delta Attention mixer on Megatron (models/mixers/kda.py) equals transformers' GLM-5.3-Flash layer
(`Glm5NextTextLinearAttention`, its torch KDA: bench/hf_kernels.py `glm5_next_modeling(fla=False)`) in float64,
float32 casts lifted (tests/hf_reference.py), at TP=1 and TP=2 (two gloo ranks, each holding its heads):

- the output over 21 tokens (chunks of 8: two whole and a tail of 5), bounded gate (lower bound -5) and unbounded
  (-e^A softplus), <= 1e-10 relative;
- the gradients of the input and of every weight (a sharded weight's slices gathered over TP), <= 1e-10;
- TP=2 equal to TP=1 (both against the same reference).

The reference's constant initialisations (the norm weight, the conv) are perturbed; A_log and dt_bias are drawn so
the decay keeps a few tokens of memory (decay-path gradients visible). Weights reach our mixer by the
rule the checkpoint table uses: q/k/v/b/f_b/g_b rows by heads, o_proj columns, conv1d [3D, 1, W] split into
q | k | v and sliced by heads, f_a/g_a whole (their output is gathered).
"""

from __future__ import annotations

import torch
from layout_compare import rel

from longstraw_mcore.launch_local import run_ranks

F64 = torch.float64
B, T, HD, H, K, W = 2, 21, 24, 4, 6, 4


def _reference(lower, seed):
    from hf_reference import LiftFloat32ToFloat64

    from longstraw_mcore.bench.hf_kernels import glm5_next_modeling

    hf = glm5_next_modeling(fla=False)
    with LiftFloat32ToFloat64():
        cfg = hf.Glm5NextTextConfig(hidden_size=HD, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=W,
                                    num_hidden_layers=1, rms_norm_eps=1e-5, pad_token_id=None)
        cfg.linear_lower_bound = lower
        torch.manual_seed(seed)
        layer = hf.Glm5NextTextLinearAttention(cfg, 0).to(F64)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if p.dim() == 1 or "conv" in n:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
        fg = layer.forget_gate
        fg.A_log.copy_(torch.rand(H, generator=gen, dtype=F64) * 0.5 - 1.0)
        # (transformers leaves dt_bias uninitialised outside `post_init`: set every entry)
        fg.dt_bias.copy_(0.3 * torch.randn(H * K, generator=gen, dtype=F64) - (1.0 if lower is None else 3.0))
    return layer


def _groups():
    """Megatron's groups at TP=2 over the two ranks, once per process, and a one-rank group of each rank's own
    (TP=1 in the same process: Megatron's groups are not rebuilt between the two)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from longstraw_mcore import cpu_compat

    cpu_compat.enable("cpu")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    solo, _ = dist.new_subgroups(group_size=1)
    return {2: ProcessGroupCollection.use_mpu_process_groups(), 1: SimpleNamespace(tp=solo)}


def _ours(layer, lower, pgs, rank):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from longstraw_mcore import cpu_compat
    from longstraw_mcore.config import Glm5NextConfig
    from longstraw_mcore.models.mixers.kda import KDAMixer, KDASubmodules

    tp = pgs.tp.size()
    m = Glm5NextConfig(vocab_size=16, hidden_size=HD, intermediate_size=8, num_layers=1,
                       mixer_types=["linear_attention"],
                       num_attention_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2, v_head_dim=2,
                       index_n_heads=1, index_head_dim=2, index_topk=4, index_kpool=4, n_routed_experts=2,
                       num_experts_per_tok=1, moe_intermediate_size=4, linear_num_heads=H, linear_head_dim=K,
                       linear_conv_kernel_dim=W, linear_lower_bound=lower, gdn_chunk_size=8, dtype="float64")
    cfg = TransformerConfig(num_layers=1, hidden_size=HD, num_attention_heads=2, tensor_model_parallel_size=tp,
                            params_dtype=F64, add_bias_linear=False, init_method_std=0.02,
                            **cpu_compat.cpu_config_overrides())
    mixer = KDAMixer(cfg, KDASubmodules(), layer_number=1, pg_collection=pgs, model_cfg=m)
    D, n = H * K, H * K // tp
    rows = slice(rank * n, (rank + 1) * n)
    ref = dict(layer.named_parameters())
    conv = ref["conv1d.weight"].detach().squeeze(1)
    fg = layer.forget_gate
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "g_b_proj"):
            getattr(mixer, name).weight.copy_(ref[name + ".weight"][rows])
        mixer.f_b_proj.weight.copy_(fg.f_b_proj.weight[rows])
        mixer.b_proj.weight.copy_(ref["b_proj.weight"][rank * (H // tp):(rank + 1) * (H // tp)])
        for name, src in (("f_a_proj", fg.f_a_proj.weight), ("g_a_proj", ref["g_a_proj.weight"])):
            getattr(mixer, name).weight.copy_(src[rank * (K // tp):(rank + 1) * (K // tp)])
        for i, name in enumerate(("conv_q", "conv_k", "conv_v")):
            getattr(mixer, name).copy_(conv[i * D:(i + 1) * D][rows])
        mixer.A_log.copy_(fg.A_log[rank * (H // tp):(rank + 1) * (H // tp)])
        mixer.dt_bias.copy_(fg.dt_bias[rows])
        mixer.o_norm.weight.copy_(ref["o_norm.weight"])
        mixer.o_proj.weight.copy_(ref["o_proj.weight"][:, rows])
    return mixer


def _gathered(t, group, dim):
    import torch.distributed as dist

    if group.size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _worker(rank, world_size):
    from hf_reference import LiftFloat32ToFloat64

    out = {}
    groups = _groups()
    for lower in (-5.0, None):
        layer = _reference(lower, seed=3 if lower is None else 5)
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(B, T, HD, generator=gen, dtype=F64, requires_grad=True)
        gy = torch.randn(B, T, HD, generator=gen, dtype=F64)
        with LiftFloat32ToFloat64():
            y_ref = layer(x)
        (y_ref * gy).sum().backward()
        ref_grads = {n: p.grad for n, p in layer.named_parameters()}
        conv_g = ref_grads["conv1d.weight"].squeeze(1)
        D = H * K
        for tp in (1, 2):
            mixer = _ours(layer, lower, groups[tp], rank if tp == 2 else 0)
            xm = x.detach().clone().transpose(0, 1).contiguous().requires_grad_(True)
            y, _ = mixer(xm)
            (y.transpose(0, 1) * gy).sum().backward()
            tg = groups[tp].tp
            got = {"q_proj.weight": _gathered(mixer.q_proj.weight.grad, tg, 0),
                   "k_proj.weight": _gathered(mixer.k_proj.weight.grad, tg, 0),
                   "v_proj.weight": _gathered(mixer.v_proj.weight.grad, tg, 0),
                   "b_proj.weight": _gathered(mixer.b_proj.weight.grad, tg, 0),
                   "g_a_proj.weight": _gathered(mixer.g_a_proj.weight.grad, tg, 0),
                   "g_b_proj.weight": _gathered(mixer.g_b_proj.weight.grad, tg, 0),
                   "forget_gate.f_a_proj.weight": _gathered(mixer.f_a_proj.weight.grad, tg, 0),
                   "forget_gate.f_b_proj.weight": _gathered(mixer.f_b_proj.weight.grad, tg, 0),
                   "forget_gate.A_log": _gathered(mixer.A_log.grad, tg, 0),
                   "forget_gate.dt_bias": _gathered(mixer.dt_bias.grad, tg, 0),
                   "o_norm.weight": mixer.o_norm.weight.grad,
                   "o_proj.weight": _gathered(mixer.o_proj.weight.grad, tg, 1),
                   "conv1d.weight": torch.cat([_gathered(getattr(mixer, c).grad, tg, 0)
                                               for c in ("conv_q", "conv_k", "conv_v")])}
            errs = {"out": rel(y.transpose(0, 1).detach(), y_ref.detach()),
                    "x.grad": rel(xm.grad.transpose(0, 1), x.grad)}
            for name, g in got.items():
                want = conv_g if name == "conv1d.weight" else ref_grads[name]
                errs[name] = rel(g, want)
            assert conv_g.shape[0] == 3 * D
            out[(lower, tp)] = errs
        x.grad = None
    return out


def test_kda_mixer_equals_transformers_at_tp1_and_tp2():
    outs = run_ranks(_worker, 2, timeout_s=300)
    for rank_out in outs:
        for (lower, tp), errs in rank_out.items():
            worst = max(errs, key=errs.get)
            print(f"KDA mixer, lower bound {lower}, TP={tp}: {len(errs)} values vs transformers, worst rel "
                  f"{errs[worst]:.1e} ({worst})")
            assert errs[worst] <= 1e-10, (lower, tp, errs)
