"""On-policy prompt groups for `train --online`: each step, each data-parallel rank draws its prompts
from the task, samples G responses per prompt from the current policy against the captured prompt
state (rollout/sampler.py), scores them with the task's reward and hands them to the trainer with
the sampled log-probs as `old_logprobs`.

Prompt `idx` (global over steps and data-parallel ranks) comes from Random(task.seed, idx), so a
resumed run draws the same prompts, and the tensor / context-parallel ranks of one data-parallel rank
draw (and sample) the same ones. Held-out prompts come from a separate stream; they are decoded
greedily (temperature 0) and scored: the learning curve.
"""

from __future__ import annotations

import random

from longstraw_mcore.config import RunConfig
from longstraw_mcore.data.rollouts import RolloutGroup
from longstraw_mcore.rollout.sampler import sample_group
from longstraw_mcore.tasks.key_recall import KeyRecall, reward


def make_task(cfg: RunConfig) -> KeyRecall:
    t = cfg.task
    return KeyRecall(vocab_size=cfg.model.vocab_size, min_len=t.min_len, max_len=t.max_len, key_len=t.key_len,
                     n_values=t.n_values, copies=t.copies)


class OnlineGroups:
    def __init__(self, cfg: RunConfig):
        self.cfg, self.task = cfg, make_task(cfg)

    def example(self, idx: int) -> tuple[list[int], list[int]]:
        return self.task.make(random.Random(self.cfg.task.seed * 1_000_003 + idx))

    def groups(self, model, step: int, dp_rank: int, dp: int, n: int) -> list[RolloutGroup]:
        out = []
        for i in range(n):
            idx = ((step - 1) * dp + dp_rank) * n + i
            prompt, key = self.example(idx)
            sg = sample_group(model, prompt, self.cfg.rollout, self.cfg.replay, index=idx)
            out.append(RolloutGroup(prompt=prompt, responses=sg.responses,
                                    rewards=[reward(r, key) for r in sg.responses], old_logprobs=sg.logprobs))
        return out

    def held_out(self, model) -> float:
        """Mean reward of greedy responses on the task's held-out prompts (every rank scores all of them)."""
        import dataclasses

        greedy = dataclasses.replace(self.cfg.rollout, temperature=0.0, group_size=1, max_tokens=self.task.key_len)
        total = 0.0
        for j in range(self.cfg.task.eval_prompts):
            prompt, key = self.example(-1 - j)
            total += reward(sample_group(model, prompt, greedy, self.cfg.replay, index=-1 - j).responses[0], key)
        return total / max(self.cfg.task.eval_prompts, 1)
