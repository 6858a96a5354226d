"""LoRA adapters == `peft` on `transformers` (float64): a random non-zero PEFT adapter on every default
target of the Qwen3.5/3.6 hybrid (attention q/k/v/o, Gated DeltaNet in_proj_qkv/z/b/a and out_proj,
MLP gate/up/down), read from the directory `peft` saved. Exact mode against every branch as its own
full sequence with autograd; detached mode against the cache path; adapter.prompt=frozen (detached
and exact) against the cache built with the adapter disabled. Per-token log-probs and every adapter
gradient <= 1e-10; the frozen base holds no gradient. At one rank, TP=2 x CP=2 and PP=2 x DP=2, through
Megatron DDP over the adapters and its finalize: each layout's gradients are gathered into PEFT's whole
tensors and compared with the same reference."""

from __future__ import annotations

import dataclasses
import tempfile

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
    from adapter_reference import worst
    from hf_reference import tiny_model_config
    from test_replay_equivalence import make_group

    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.adapters.peft_io import gather_canonical, read_peft
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import AdapterConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import GRPOConfig, advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import run_group
    from longstraw_mcore.train.trainer import wrap_ddp

    m = tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)  # CP=2 x TP=2 splits GDN by heads
    fam = get_family(m.family)
    gcfg = GRPOConfig(beta=0.05)
    groups = [make_group(m, 13, [5, 1, 7], 11), make_group(m, 6, [3, 4], 12)]
    base, d, ref = _reference(m, groups, gcfg) if rank == 0 else (None, None, None)
    box = [base, d]
    dist.broadcast_object_list(box, src=0)
    base, d = box
    out = []
    for layout in LAYOUTS[world_size]:
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(**layout), device="cpu"))
        model = fam.build_model(m, par, "cpu")
        load_full(model, base)
        sites = fam.checkpoint.adapter_sites(m)
        cfg, canon = read_peft(d, sites, AdapterConfig())
        aset = attach(model, sites, cfg, par, seed=0, canonical=canon, padded_vocab=model.padded_vocab_size)
        # Megatron DDP over the adapters (the only trainable parameters): its average over data x context
        # parallel ranks completes the gradients, as in training
        ddp = wrap_ddp(model, RunConfig(model=m, parallel=ParallelConfig(**layout), device="cpu"), par)
        # exact mode with prompt=frozen runs as detached (replay/engine.py): checked at one rank, the same
        # plan as detached-frozen under the other layouts
        cases = (("exact", False), ("detached", False), ("detached", True)) + ((("exact", True),) if world_size == 1
                                                                               else ())
        for mode, frozen in cases:
            aset.cfg = dataclasses.replace(cfg, prompt="frozen" if frozen else "adapted")
            rc = ReplayConfig(mode=mode, chunk_len=4)
            worst_lp, worst_g = 0.0, (0.0, "")
            base_grads = 0
            for gi, group in enumerate(groups):
                fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
                ddp.zero_grad_buffer()
                res, _ = run_group(ddp, group.prompt, group.responses, fn, rc)
                finalize_model_grads([ddp], pg_collection=par.pgs)
                base_grads += sum(p.grad is not None or hasattr(p, "main_grad")
                                  for n, p in model.named_parameters() if not n.startswith("adapters."))
                g = gather_canonical(aset, par, grads=True)
                every = [None] * world_size if rank == 0 else None
                dist.gather_object([r.logprobs for r in res], every, dst=0)  # the last stage holds them
                if rank == 0:
                    lp_ref, g_ref = ref[("exact", False) if (mode, frozen) == ("exact", False) else ("detached", frozen)][gi]
                    lps = next(x for x in every if x)
                    worst_lp = max(worst_lp, max(float((a - b).abs().max()) for a, b in zip(lps, lp_ref)))
                    worst_g = max(worst_g, worst(g, g_ref))
            out.append(dict(layout=layout, mode=mode, frozen=frozen, logp=worst_lp, grad=worst_g[0], at=worst_g[1],
                            base_grads=base_grads, n_adapters=len(aset.lora)))
    return out


def _check(out):
    for r in out:
        print(f"{r['layout'] or 'one rank'} {r['mode']}{' prompt=frozen' if r['frozen'] else ''}: logp {r['logp']:.1e}, "
              f"worst adapter grad {r['grad']:.1e} ({r['at']}), {r['n_adapters']} adapters on rank 0")
    for r in out:
        assert r["logp"] <= 1e-10 and r["grad"] <= 1e-10, r
        assert r["base_grads"] == 0, r


def test_qwen_lora_one_rank_equals_peft():
    _check(run_ranks(_worker, 1, timeout_s=600)[0])


def test_qwen_lora_tp_cp_and_pp_equal_peft():
    _check(run_ranks(_worker, 4, timeout_s=900)[0])
