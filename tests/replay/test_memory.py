"""Replay memory does not grow with the group size: the measured peak of a whole group step with G=8
exceeds the G=2 peak by at most one micro-step's scratch (the graph of one replay micro-step: its
activations, its log-prob chunk; with `replay.attn_probs_budget_mib` also its attention
probabilities), in both modes, at fixed P and R: one branch per micro-step (replay.batch_tokens=0),
and under a token budget of two branches (G=2 is one micro-step, G=8 four of the same size). Measured
with PyTorch's profiler memory timeline on CPU (longstraw_mcore/bench/memory.py)."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def _worker(rank, world_size):
    from longstraw_mcore.bench.memory import measure_peak
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import capture, make_leaves, replay_branches
    from longstraw_mcore.replay.group_step import process_group

    from hf_reference import tiny_model_config

    # one GDN + one gated attention layer: the profiler's memory timeline costs per op, keep ops few
    m = tiny_model_config(num_layers=2, full_attention_interval=2, vocab_size=256, dtype="float32", gdn_chunk_size=16)
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m, par, "cpu")
    g = torch.Generator().manual_seed(0)
    P, R = 64, 12
    prompt = torch.randint(0, m.vocab_size, (P,), generator=g).tolist()
    out = {}
    # the third variant keeps each branch's attention probabilities (part of that branch's scratch); the
    # fourth replays two branches per micro-step (a budget of 2 x R tokens)
    for name, mode, budget, per in (("detached", "detached", 0.0, 1), ("exact", "exact", 0.0, 1),
                                    ("detached+stored probs", "detached", 64.0, 1),
                                    ("exact, 2 branches per micro-step", "exact", 0.0, 2)):
        rcfg = ReplayConfig(mode=mode, chunk_len=16, attn_probs_budget_mib=budget,
                            batch_tokens=0 if per == 1 else per * R)
        peaks = {}
        for G in (2, 8):
            grp = RolloutGroup(prompt=prompt, responses=[torch.randint(0, m.vocab_size, (R,), generator=g).tolist()
                                                         for _ in range(G)], rewards=[float(i % 3) for i in range(G)])
            model.zero_grad(set_to_none=True)
            _, peaks[G], how = measure_peak(lambda: process_group(model, grp, rcfg, GRPOConfig()), par.device)
        # one micro-step's scratch: replay one more once parameter (and state) gradients exist
        grp2 = RolloutGroup(prompt=prompt, responses=grp.responses[:2 * per],
                            rewards=[float(i % 2) for i in range(2 * per)])
        fn = group_loss_fn(grp2, GRPOConfig(), advantages(grp2.rewards, GRPOConfig()))
        state = capture(model, torch.tensor([prompt[:-1]]), rcfg)
        leaves = make_leaves(state) if mode == "exact" else None
        replay_branches(model, state, prompt[-1], grp2.responses, list(range(per)), fn, rcfg, leaves)
        _, scratch, _ = measure_peak(lambda: replay_branches(model, state, prompt[-1], grp2.responses,
                                                             list(range(per, 2 * per)), fn, rcfg, leaves), par.device)
        out[name] = dict(g2=peaks[2], g8=peaks[8], scratch=scratch, how=how, state=state.nbytes())
    return out


def test_peak_does_not_grow_with_group_size():
    out = run_ranks(_worker, 1, timeout_s=600)[0]
    for mode, r in out.items():
        print(f"{mode}: peak G=2 {r['g2'] / 2**20:.3f} MiB, G=8 {r['g8'] / 2**20:.3f} MiB, difference "
              f"{(r['g8'] - r['g2']) / 2**10:.1f} KiB; one micro-step's scratch {r['scratch'] / 2**10:.1f} KiB; "
              f"state {r['state'] / 2**10:.1f} KiB ({r['how']})")
    for mode, r in out.items():
        assert r["scratch"] > 0 and r["g2"] > 0
        assert r["g8"] - r["g2"] <= r["scratch"], (mode, r)
