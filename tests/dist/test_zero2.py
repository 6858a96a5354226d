"""Gradients reduced per micro-step (train.grad_reduction=micro_step, train/zero2.py): 4 gloo ranks,
DP=2 x CP=2, exact mode, float64, two GRPO groups per data-parallel rank.

- After every group (its branches' and its prompt sweep's micro-steps) no parameter holds a
  full-size `.grad`: the rank's gradient bytes are its shards, 1/(DP x CP) of the model's (padding
  aside). The two DP ranks' groups have different prompt lengths, hence different numbers of
  micro-steps: the reduction rounds must still line up.
- The shards, gathered, equal the single-rank gradient of the same groups (<= 1e-10), and one
  optimizer step equals torch AdamW on the single-rank gradient (<= 1e-10), weight decay on matrices
  only (as Megatron's optimizer).
- memory.grad_offload (memory/grad_stage.py): the same groups in exact and detached mode, with every
  micro-step's gradient staged in host memory as autograd completes it: at every micro_step_done no
  parameter holds a `.grad` (the full-size gradient never sat on the device), and the shards and the
  parameters after the AdamW step are bit-identical (torch.equal) to the run without it.
(The peak's independence of G under CP is measured in tests/dist/test_context_parallel.py: the
profiler's memory timeline does not follow the in-place shard updates made here.)
Why CP ranks' shards add up: see prompt_state/contexts.py (replicated replay, partial recompute x CP)."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def _worker(rank, world_size):
    import os
    import sys

    import torch.distributed as dist
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from hf_reference import build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import make_group

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group

    m = tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)
    full = hf_to_mcore(hf_state(build_hf_model(m, seed=71)), m)
    groups = [make_group(m, 25 + 2 * i, [4, 1, 6][: 2 + i % 2], seed=72 + i) for i in range(4)]
    rcfg, gcfg = ReplayConfig(mode="exact", chunk_len=7), GRPOConfig(beta=0.05)
    train = TrainConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, grad_reduction="micro_step")

    # single rank: plain autograd over every group, then torch AdamW
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    ref = build_model(m, par, "cpu")
    load_full(ref, full)
    for g in groups:
        process_group(ref, g, rcfg, gcfg, scale=1 / len(groups))
    names = [n for n, _ in ref.named_parameters()]
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    adam = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() > 1], "weight_decay": 0.1},
                              {"params": [p for p in ref.parameters() if p.dim() == 1], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    adam.step()
    ref_after = {n: p.detach().clone() for n, p in ref.named_parameters()}

    grads, opt, model, par, after_each, _ = _sharded(m, full, groups, rcfg, gcfg, train, offload=False)
    full_bytes = sum(p.numel() for p in model.parameters()) * 8
    # gather the shards into full gradients
    worst = 0.0
    for name, p in zip(names, model.parameters()):
        shard = grads.grad[p]
        parts = torch.empty(shard.numel() * grads.n, dtype=shard.dtype)
        dist.all_gather_into_tensor(parts, shard, group=grads.group)
        g_full = parts[:p.numel()].view_as(p)
        worst = max(worst, float((g_full - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-300)))
    opt.step()
    step = max(float((p.detach() - ref_after[n]).abs().max() / ref_after[n].abs().max()) for n, p in
               zip(names, model.parameters()))

    offload = {}
    for mode in ("exact", "detached"):
        rc = ReplayConfig(mode=mode, chunk_len=7)
        runs = [_sharded(m, full, groups, rc, gcfg, train, offload=o) for o in (False, True)]
        (g0, o0, m0, *_), (g1, o1, m1, _, _, held) = runs
        shards = all(torch.equal(a, b) for a, b in zip(g0.shard, g1.shard))
        o0.step()
        o1.step()
        params = all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
        offload[mode] = dict(shards=shards, params=params, held=held, micro=len(held), stage=g1.stage.nbytes(),
                             host=g1.host_bytes(), rounds=(g0.rounds, g1.rounds))
    return dict(after_each=after_each, full_bytes=full_bytes, n=grads.n, grad=worst, step=step, rounds=grads.rounds,
                padding=sum(grads.per[p] * grads.n - p.numel() for p in model.parameters()) * 8, offload=offload)


def _sharded(m, full, groups, rcfg, gcfg, train, offload: bool):
    """DP=2 x CP=2 micro_step shards after this rank's groups: (holder, optimizer, model, par, [(gradient
    bytes, parameters with a .grad) after each group], [parameters with a .grad at each micro_step_done])."""
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import MemoryConfig, ParallelConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import build_training

    cfg = RunConfig(model=m, parallel=ParallelConfig(cp=2), device="cpu", train=train,
                    memory=MemoryConfig(grad_offload=offload))
    par = setup_parallel(cfg)
    model = build_model(m, par, "cpu")
    load_full(model, full)
    grads, opt = build_training(model, cfg, par)
    held, done = [], grads.micro_step_done

    def recording():  # how many parameters hold a full-size .grad when the micro-step's backward is over
        held.append(sum(p.grad is not None for p in model.parameters()))
        done()
    grads.micro_step_done = recording
    after_each = []
    for i, g in enumerate(groups):
        if i % par.dp == par.pgs.dp.rank():
            process_group(grads, g, rcfg, gcfg, scale=par.dp / len(groups))
            after_each.append((grads.grad_bytes(), sum(p.grad is not None for p in model.parameters())))
    grads.finish()  # the DP ranks' groups differ in micro-steps: join rounds until all are done
    return grads, opt, model, par, after_each, held


def test_micro_step_shards_equal_single_rank_free_full_gradients_and_offload_bit_identical():
    for rank, r in enumerate(run_ranks(_worker, 4, timeout_s=900)):
        if rank == 0:
            print(f"DP=2 x CP=2 micro-step shards: gradient vs single rank {r['grad']:.1e}, AdamW step {r['step']:.1e}; "
                  f"gradient bytes per rank after each group {[b for b, _ in r['after_each']]} of a full "
                  f"{r['full_bytes']} (1/{r['n']} = {r['full_bytes'] // r['n']} + padding {r['padding'] // r['n']}); "
                  f"{r['rounds']} reduction rounds")
        assert r["grad"] <= 1e-10 and r["step"] <= 1e-10, r
        for nbytes, full_grads in r["after_each"]:
            assert full_grads == 0 and nbytes == (r["full_bytes"] + r["padding"]) // r["n"], r["after_each"]
        for mode, o in r["offload"].items():
            if rank == 0:
                print(f"memory.grad_offload, {mode}: shards bit-identical {o['shards']}, parameters after AdamW "
                      f"bit-identical {o['params']}; parameters holding a .grad at each of {o['micro']} micro-steps' "
                      f"end: {sorted(set(o['held']))}; host bytes {o['host']} (staging {o['stage']} = the full "
                      f"gradient {r['full_bytes']}); rounds {o['rounds']}")
            assert o["shards"] and o["params"], o
            assert o["micro"] > 0 and set(o["held"]) == {0}, o  # never a full-size .grad at a micro-step's end
            assert o["stage"] == r["full_bytes"] and o["host"] == o["stage"] + (r["full_bytes"] + r["padding"]) // r["n"]


def _ep_worker(rank, world_size):
    """GLM (MLA + DSA + MoE) at DP=2 x EP=2, float64, exact mode: the shards against one rank."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from test_memory_switches import _glm
    from test_replay_equivalence import make_group

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import build_training

    m, full = _glm()
    groups = [make_group(m, 14, [3, 5], seed=90 + i) for i in range(2)]  # one per DP rank, the same shape
    rcfg, gcfg = ReplayConfig(mode="exact", chunk_len=5), GRPOConfig(beta=0.05)
    build = get_family(m.family).build_model

    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    ref = build(m, par, "cpu")
    load_full(ref, full)
    for g in groups:
        process_group(ref, g, rcfg, gcfg, scale=1 / len(groups))
    want = gather_full(ref, grads=True)
    want_norm = sum(float(t.double().pow(2).sum()) for t in want.values()) ** 0.5

    cfg = RunConfig(model=m, parallel=ParallelConfig(ep=2), device="cpu",
                    train=TrainConfig(lr=1e-2, clip_grad=0.0, grad_reduction="micro_step"))
    par = setup_parallel(cfg)
    model = build(m, par, "cpu")
    load_full(model, full)
    grads, opt = build_training(model, cfg, par)
    process_group(grads, groups[par.pgs.dp.rank()], rcfg, gcfg, scale=par.dp / len(groups))
    grads.finish()
    norm = opt.grad_norm()
    experts = sum(1 for p in grads.params if grads.group_of[p] is not grads.group)
    for p in grads.params:  # the reduced gradients back in the parameters' shape, to gather by name
        p.grad = grads.whole(p, grads.grad[p]).clone()
    got = gather_full(model, grads=True)
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300)) for k in want)
    return dict(worst=worst, norm=norm, want_norm=want_norm, experts=experts, keys=(sorted(got) == sorted(want)))


def test_micro_step_shards_reduce_routed_experts_over_expert_data_parallel():
    """Routed experts are whole on their EP rank, each EP rank holding others: their gradients are reduced
    over expert data parallel (as Megatron DDP does), not over data parallel, which would add different
    experts' gradients together. DP=2 x EP=2 (2 ranks), GLM MLA/DSA/MoE, float64: every gradient equals
    one rank's (<= 1e-10) and so does the norm the optimizer clips by (<= 1e-12 relative)."""
    for rank, r in enumerate(run_ranks(_ep_worker, 2, timeout_s=900)):
        if rank == 0:
            print(f"GLM DP=2 x EP=2 micro_step shards vs one rank: worst gradient {r['worst']:.1e} ({r['experts']} routed "
                  f"expert tensors on this rank), grad norm {r['norm']!r} vs {r['want_norm']!r}")
        assert r["keys"] and r["experts"] > 0 and r["worst"] <= 1e-10, r
        assert abs(r["norm"] - r["want_norm"]) <= 1e-12 * r["want_norm"], r
