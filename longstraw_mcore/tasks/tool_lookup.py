"""Tool lookup: a two-turn agent task whose tool output is context, not action (a loss-masked token),
small enough for a CPU.

    prompt    d d d ... d  M                        distractors and the marker: no information
    turn 1    c                                     the policy's call (any token: the tool answers every call)
    tool      v  (loss mask 0)                      the episode's secret value
    turn 2    a                                     the policy's answer
    reward    1 if a == v (the secret), else 0

The secret is uniform over `n_values` values and appears nowhere but in the tool's output, so a policy
that ignores what the tool wrote scores at most 1 / n_values (`chance`). A response is [c, v, a] with
loss mask [1, 0, 1]: the tool's token is never trained (its log-prob is still computed and reported;
trained, the policy would be taught to predict a random secret). Branches of a group that make the
same call share [c, v]: the prefix tree replays that segment once (replay/tree.py).

Measured (docs/learning.md): with the answer only rewarded after a call of one particular token, GRPO first
learnt to make that call and, meanwhile, collapsed its answer onto one value (the prompt-ignoring
optimum, 1 / n_values; its groups then had equal rewards and no gradient) before learning to copy;
so every call is answered.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from longstraw_mcore.data.rollouts import RolloutGroup
from longstraw_mcore.tasks.vocabulary import TaskVocabulary


@dataclass(frozen=True)
class ToolLookup(TaskVocabulary):
    """The task of `cfg` over a model vocabulary of `vocab_size` tokens (tasks/vocabulary.py)."""

    def make(self, rng: random.Random, lengths: tuple[int, int] | None = None) -> tuple[list[int], int]:
        """(prompt, secret) for one example; the prompt's length is uniform in `lengths`."""
        n = rng.randint(*(lengths or (self.cfg.min_len, self.cfg.max_len)))
        secret = rng.choice(self.values)
        return [rng.randrange(self.first_distractor, self.vocab_size) for _ in range(n - 1)] + [self.marker], secret

    def tool(self, call: int, secret: int) -> int:
        """The tool's answer to a call: the episode's secret."""
        return secret

    def rollout(self, model, prompt: list[int], secret: int, rcfg, replay, index: int, state=None):
        """One group: G first turns sampled from the prompt's state, the tool's answers appended, G second
        turns sampled after them (one token each). Returns (the group with its loss masks, the state)."""
        from longstraw_mcore.rollout.sampler import sample_group

        one = dataclasses.replace(rcfg, max_tokens=1, stop_ids=[])
        first = sample_group(model, prompt, one, replay, index=2 * index, state=state)
        tools = [[self.tool(r[0], secret)] for r in first.responses]
        second = sample_group(model, prompt, one, replay, index=2 * index + 1, state=first.state,
                              prefixes=[r + t for r, t in zip(first.responses, tools)])
        responses = second.responses
        # the tool's token: no loss term; its old log-prob (unused: masked) recorded as 0
        old = [a + [0.0] + b for a, b in zip(first.logprobs, second.logprobs)]
        group = RolloutGroup(prompt=prompt, responses=responses, rewards=[reward(r, secret) for r in responses],
                             old_logprobs=old, loss_masks=[[1, 0, 1] for _ in responses])
        return group, first.state

    def greedy_reward(self, model, prompt: list[int], secret: int, rcfg, replay, index: int) -> float:
        greedy = dataclasses.replace(rcfg, temperature=0.0, group_size=1)
        return self.rollout(model, prompt, secret, greedy, replay, index)[0].rewards[0]


def reward(response: list[int], secret: int) -> float:
    return float(len(response) == 3 and response[2] == secret)
