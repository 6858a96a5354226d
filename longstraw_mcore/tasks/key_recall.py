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
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from longstraw_mcore.config import ConfigError


@dataclass(frozen=True)
class KeyRecall:
    vocab_size: int
    min_len: int = 64
    max_len: int = 256
    key_len: int = 2
    n_values: int = 16
    copies: int = 1
    """The key appears this many times, at independent random positions."""
    marker: int = 1

    def __post_init__(self):
        if not 1 <= self.key_len <= 16:
            raise ConfigError(f"task.key_len={self.key_len}: must be 1..16")
        if not 2 <= self.n_values:
            raise ConfigError(f"task.n_values={self.n_values}: must be >= 2")
        if not 1 <= self.copies or self.min_len < self.copies * self.key_len + 8:
            raise ConfigError(f"task.copies={self.copies}: must be >= 1 and fit task.min_len={self.min_len}")
        if not 8 <= self.min_len <= self.max_len:
            raise ConfigError(f"task.min_len={self.min_len}, task.max_len={self.max_len}: need 8 <= min_len <= max_len")
        if self.vocab_size < self.first_distractor + 8:
            raise ConfigError(f"model.vocab_size={self.vocab_size} is too small for key recall with "
                              f"{self.n_values} values (needs >= {self.first_distractor + 8})")

    @property
    def values(self) -> range:
        return range(self.marker + 1, self.marker + 1 + self.n_values)

    @property
    def first_distractor(self) -> int:
        return self.marker + 1 + self.n_values

    @property
    def chance(self) -> float:
        """The expected reward of the best policy that ignores the prompt."""
        return 1.0 / self.n_values

    def make(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """(prompt, key) for one example."""
        n = rng.randint(self.min_len, self.max_len)
        key = [rng.choice(self.values) for _ in range(self.key_len)]
        fill = [rng.randrange(self.first_distractor, self.vocab_size)
                for _ in range(n - self.copies * self.key_len - 1)]
        for at in sorted((rng.randint(0, len(fill)) for _ in range(self.copies)), reverse=True):
            fill[at:at] = key
        prompt = fill + [self.marker]
        return prompt, key


def reward(response: list[int], key: list[int]) -> float:
    """Fraction of the key's positions the response gets right (extra or missing tokens score 0)."""
    if not key:
        raise ValueError("empty key")
    return sum(1 for a, b in zip(response, key) if a == b) / len(key)
