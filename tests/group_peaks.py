"""The memory property of branch replay on a built model: the peak of an exact-mode group step at G=2
and at G=8 (same prompt, 6-token branches, chunks of 64), and one branch's scratch (replaying one more
branch against a captured state). Peak growth from G=2 to G=8 must stay below one branch's scratch.
One branch per micro-step (replay.batch_tokens=0): under a budget a micro-step holds up to that many
tokens whatever G is (tests/replay/test_memory.py holds that bound)."""
from __future__ import annotations

import torch


def group_peaks(model, m, device, prompt: list[int], gen: torch.Generator) -> dict:
    from longstraw_mcore.bench.memory import measure_memory
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.replay.engine import capture, make_leaves, replay_branches
    from longstraw_mcore.replay.group_step import process_group

    rcfg = ReplayConfig(mode="exact", chunk_len=64, batch_tokens=0)
    peaks = {}
    for G in (2, 8):
        grp = RolloutGroup(prompt=prompt, responses=[torch.randint(0, m.vocab_size, (6,), generator=gen).tolist()
                                                     for _ in range(G)], rewards=[float(i % 3) for i in range(G)])
        process_group(model, grp, rcfg, GRPOConfig())  # warm: parameter gradients exist
        # gloo frees some collective buffers asynchronously, so a measurement can include a buffer of the
        # previous step still alive (under CP, +-0.35 MB between runs, half a branch's scratch): the lowest of four
        peaks[G] = min(measure_memory(lambda: process_group(model, grp, rcfg, GRPOConfig()), device)[1]
                       for _ in range(4))
    fn = group_loss_fn(grp, GRPOConfig(), advantages(grp.rewards, GRPOConfig()))
    state = make_leaves(capture(model, torch.tensor([prompt[:-1]]), rcfg))
    replay_branches(model, state, prompt[-1], grp.responses, [0], fn, rcfg)
    scratch = measure_memory(lambda: replay_branches(model, state, prompt[-1], grp.responses, [1], fn, rcfg),
                             device)[1]
    return dict(peaks=peaks, scratch=scratch)
