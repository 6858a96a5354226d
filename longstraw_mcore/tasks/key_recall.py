"""Key recall: a long-context task with a verifiable reward, small enough for a CPU.

A prompt is distractor tokens with one key hidden at a random position: `key_len` value tokens (a
vocabulary of their own, `n_values` of them, which no distractor uses). The prompt ends with the
marker token; the response must repeat the key.

    prompt    d d d ... d  v1 v2 .. vk  d d ... d  M            (vocabulary: M, values, distractors apart)
    response  v1 v2 .. vk
    reward    the fraction of the k positions answered right (partial credit keeps the signal dense)

Why it needs the context: the key is uniform over `n_values ** key_len` choices and appears only in
the prompt, so a policy that ignores the prompt scores at most 1 / n_values per position, in
expectation, whatever it learns (its best guess is any fixed value): that is the task's `chance`.
A model must find the key (anywhere in the prompt: the only value tokens in it) and copy it.

Lengths: `make` draws a prompt length uniformly from the lengths it is given; `train --online` passes
the config's curriculum (TaskConfig.lengths: short prompts first, then the full [min_len, max_len]),
held-out prompts always use the full lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from longstraw_mcore.tasks.vocabulary import TaskVocabulary


@dataclass(frozen=True)
class KeyRecall(TaskVocabulary):
    """The task of `cfg` (task.* in a run config: lengths, key length, values, copies; checked there) over a
    model vocabulary of `vocab_size` tokens (tasks/vocabulary.py: marker, values, distractors)."""

    def make(self, rng: random.Random, lengths: tuple[int, int] | None = None) -> tuple[list[int], list[int]]:
        """(prompt, key) for one example; its length is uniform in `lengths` (default: [min_len, max_len])."""
        c = self.cfg
        n = rng.randint(*(lengths or (c.min_len, c.max_len)))
        key = [rng.choice(self.values) for _ in range(c.key_len)]
        fill = [rng.randrange(self.first_distractor, self.vocab_size) for _ in range(n - c.copies * c.key_len - 1)]
        for at in sorted((rng.randint(0, len(fill)) for _ in range(c.copies)), reverse=True):
            fill[at:at] = key
        prompt = fill + [self.marker]
        return prompt, key


    def rollout(self, model, prompt: list[int], key: list[int], rcfg, replay, index: int, state=None):
        """One group: G responses sampled from the prompt's state and scored. Returns (group, state)."""
        from longstraw_mcore.data.rollouts import RolloutGroup
        from longstraw_mcore.rollout.sampler import sample_group

        sg = sample_group(model, prompt, rcfg, replay, index=index, state=state)
        return RolloutGroup(prompt=prompt, responses=sg.responses, rewards=[reward(r, key) for r in sg.responses],
                            old_logprobs=sg.logprobs), sg.state

    def greedy_reward(self, model, prompt: list[int], key: list[int], rcfg, replay, index: int) -> float:
        import dataclasses

        greedy = dataclasses.replace(rcfg, temperature=0.0, group_size=1, max_tokens=self.cfg.key_len)
        return self.rollout(model, prompt, key, greedy, replay, index)[0].rewards[0]


def reward(response: list[int], key: list[int]) -> float:
    """Fraction of the key's positions the response gets right (extra or missing tokens score 0)."""
    if not key:
        raise ValueError("empty key")
    return sum(1 for a, b in zip(response, key) if a == b) / len(key)
