"""On-policy prompt groups for `train --online`: each step, each data-parallel rank draws its prompts
from the task, samples G responses per prompt from the current policy against the captured prompt
state (rollout/sampler.py; the task's `rollout`: one turn for key recall, two around a loss-masked
tool output for tool lookup), scores them with the task's reward and hands them to the trainer with
the sampled log-probs as `old_logprobs`.

Prompt `idx` (global over steps and data-parallel ranks) comes from Random(task.seed, idx), so a
resumed run draws the same prompts, and the tensor / context / pipeline ranks of one data-parallel
rank draw (and sample) the same ones. Training prompts follow the task's length curriculum
(task.start_len -> [min_len, max_len], TaskConfig.lengths). Held-out prompts come from a separate
stream at the task's full lengths; they are decoded greedily (temperature 0), split over the
data-parallel ranks, and scored: the learning curve.
"""

from __future__ import annotations

import random

from longstraw_mcore.config import RunConfig
from longstraw_mcore.data.rollouts import RolloutGroup
from longstraw_mcore.tasks.key_recall import KeyRecall
from longstraw_mcore.tasks.tool_lookup import ToolLookup


def make_task(cfg: RunConfig):
    """The task.name task (KeyRecall or ToolLookup) over the model's vocabulary."""
    return (ToolLookup if cfg.task.name == "tool_lookup" else KeyRecall)(cfg.task, cfg.model.vocab_size)


class OnlineGroups:
    def __init__(self, cfg: RunConfig):
        self.cfg, self.task = cfg, make_task(cfg)
        self.states: dict = {}   # slot -> the prompt state its group was sampled against (adapter.prompt=frozen)
        self.reused = 0          # groups of the last call whose state came from an earlier step

    def example(self, idx: int, lengths: tuple[int, int] | None = None) -> tuple[list[int], object]:
        return self.task.make(random.Random(self.cfg.task.seed * 1_000_003 + idx), lengths)

    def groups(self, model, step: int, dp_rank: int, dp: int, n: int) -> list[RolloutGroup]:
        """This rank's `n` groups of `step`. With adapter.prompt=frozen the prompt states sampled against
        are kept (`states`: the trainer replays against them instead of capturing again), and with
        replay.reuse_steps=K the same prompts serve K consecutive steps, their states captured once
        (at a block's first step, or again after a resume), new branches sampled each step."""
        from longstraw_mcore.replay.steps import prompt_is_frozen

        K = self.cfg.replay.reuse_steps
        block, within = divmod(step - 1, K)
        keep = prompt_is_frozen(model)
        if within == 0 or not keep:
            self.states = {}
        out, reused = [], 0
        lengths = self.cfg.task.lengths(block * K + 1)
        for i in range(n):
            idx = (block * dp + dp_rank) * n + i
            prompt, key = self.example(idx, lengths)
            state = self.states.get(i)
            reused += state is not None
            group, st = self.task.rollout(model, prompt, key, self.cfg.rollout, self.cfg.replay, idx * K + within,
                                          state)
            if keep:
                self.states[i] = st
            out.append(group)
        self.reused = reused
        return out

    def held_out(self, model, dp_group, device) -> float:
        """Mean reward of greedy responses on the task's held-out prompts; data-parallel rank r decodes
        prompts r, r + dp, ..., and the sum is reduced over `dp_group` (the same number on every rank)."""
        from longstraw_mcore.parallel.reduce import all_reduce_sum

        n = self.cfg.task.eval_prompts
        total = 0.0
        for j in range(dp_group.rank(), n, dp_group.size()):
            prompt, key = self.example(-1 - j)
            total += self.task.greedy_reward(model, prompt, key, self.cfg.rollout, self.cfg.replay, -1 - j)
        return all_reduce_sum([total], dp_group, device)[0] / max(n, 1)
