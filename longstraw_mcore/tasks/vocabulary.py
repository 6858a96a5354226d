"""The token layout the built-in tasks share: token 0 unused, the marker, `task.n_values` value tokens,
then distractors up to the model's vocabulary (checked against it: TaskConfig.check_vocab)."""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_mcore.config import TaskConfig


@dataclass(frozen=True)
class TaskVocabulary:
    cfg: TaskConfig
    vocab_size: int
    marker: int = 1

    def __post_init__(self):
        self.cfg.check_vocab(self.vocab_size)

    @property
    def values(self) -> range:
        return range(self.marker + 1, self.marker + 1 + self.cfg.n_values)

    @property
    def first_distractor(self) -> int:
        return self.marker + 1 + self.cfg.n_values

    @property
    def chance(self) -> float:
        """The expected reward of the best policy that ignores what only the context holds (the key in
        the prompt, the tool's output): one value in n_values."""
        return 1.0 / self.cfg.n_values
