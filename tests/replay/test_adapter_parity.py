"""LoRA adapters == `peft` on `transformers` (float64): a random non-zero PEFT adapter on every default
target of the Qwen3.5/3.6 hybrid (attention q/k/v/o, Gated DeltaNet in_proj_qkv/z/b/a and out_proj,
MLP gate/up/down), read from the directory `peft` saved. Exact mode against every branch as its own
full sequence with autograd; detached mode against the cache path; adapter.prompt=frozen (detached
and exact) against the cache built with the adapter disabled. Per-token log-probs and every adapter
gradient <= 1e-10; the frozen base holds no gradient. At one rank, TP=2 x CP=2 and PP=2 x DP=2, through
Megatron DDP over the adapters and its finalize: each layout's gradients are gathered into PEFT's whole
tensors and compared with the same reference."""

from __future__ import annotations

import tempfile

from adapter_reference import check_layouts

from longstraw_mcore.launch_local import run_ranks

LAYOUTS = {1: [dict()], 4: [dict(tp=2, cp=2), dict(pp=2)]}  # pp=2 on 4 ranks: dp=2


def _reference(m, groups, gcfg):
    """Per case (mode, frozen): the reference log-probs and adapter gradients, and the adapter dir."""
    from adapter_reference import cache_path, full_sequence, lora_grads, random_peft
    from hf_reference import LiftFloat32ToFloat64, build_hf_model, hf_state

    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn

    with LiftFloat32ToFloat64():
        hf = build_hf_model(m, seed=7)
    base = hf_to_mcore(hf_state(hf), m)
    targets = [t for t in m.projection_shapes() if t != "lm_head"]
    peft_model = random_peft(hf, targets, r=4, alpha=8.0, seed=3)
    d = tempfile.mkdtemp(prefix="peft-")
    peft_model.save_pretrained(d)
    ref = {}
    for case in (("exact", False), ("detached", False), ("detached", True)):
        per_group = []
        for group in groups:
            fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
            peft_model.zero_grad(set_to_none=True)
            if case == ("exact", False):
                lp = full_sequence(peft_model, group, fn, LiftFloat32ToFloat64)
            else:
                lp = cache_path(peft_model, group, fn, LiftFloat32ToFloat64, frozen_prompt=case[1])
            per_group.append((lp, lora_grads(peft_model)))
        ref[case] = per_group
    return base, d, ref


def _worker(rank, world_size):
    from adapter_reference import compare_layouts
    from hf_reference import tiny_model_config
    from test_replay_equivalence import make_group

    from longstraw_mcore.loss.grpo import GRPOConfig

    m = tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)  # CP=2 x TP=2 splits GDN by heads
    gcfg = GRPOConfig(beta=0.05)
    groups = [make_group(m, 13, [5, 1, 7], 11), make_group(m, 6, [3, 4], 12)]
    return compare_layouts(m, groups, gcfg, lambda: _reference(m, groups, gcfg), LAYOUTS[world_size], 4, rank,
                           world_size)


def test_qwen_lora_one_rank_equals_peft():
    check_layouts(run_ranks(_worker, 1, timeout_s=600)[0])


def test_qwen_lora_tp_cp_and_pp_equal_peft():
    check_layouts(run_ranks(_worker, 4, timeout_s=900)[0])
