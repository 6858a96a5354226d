"""The sections of a run that bring the user's own task (`train --online --dataset`, `rollout --dataset`):
how a text dataset is read, how reward functions are run and weighed, how an environment's episodes
are bounded. The files and the code themselves come from the command line (--dataset, --reward, --env);
tasks/ holds what reads and runs them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from longstraw_mcore.config.errors import ConfigError, check_choices, check_ints


@dataclass(kw_only=True)
class DatasetConfig:
    """A JSON Lines dataset of prompts (tasks/text_dataset.py)."""

    shuffle: bool = True
    """A new order every epoch (a permutation keyed by (seed, epoch)); false: the file's order."""
    seed: int = 0
    max_prompt_tokens: int = 0
    """Longest prompt in tokens after the chat template; 0: rollout.max_prompt_len."""
    overlong: Literal["refuse", "truncate"] = "refuse"
    """A longer prompt: `refuse` the dataset (exit 2, naming the row) or `truncate` it to its last
    max_prompt_tokens tokens (counted, reported at start)."""

    def __post_init__(self):
        check_choices(self, "dataset")
        check_ints(self, "dataset", ("seed", "max_prompt_tokens"), low=0, words="an integer >= 0")


@dataclass(kw_only=True)
class RewardConfig:
    """Reward functions (`--reward module:function`, repeatable), run in worker processes (tasks/rewards.py)."""

    weights: list[float] = field(default_factory=list)
    """One weight per --reward, in order; []: every weight 1. The reward a response trains on is the weighted sum."""
    timeout_s: float = 30.0
    """Per call (one group's responses): a call that runs longer is abandoned, its worker replaced."""
    workers: int = 2
    """Worker processes per data-parallel rank (on the first rank of each model replica)."""
    on_failure: float = 0.0
    """The reward given for a call that raised, timed out, crashed, or returned a non-finite value or the
    wrong number of values (counted in the metrics, logged once per kind)."""

    def __post_init__(self):
        check_ints(self, "reward", ("workers",))
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"reward.timeout_s={self.timeout_s!r}: must be a number of seconds > 0")
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in self.weights):
            raise ConfigError(f"reward.weights={self.weights!r}: must be a list of finite numbers")
        if not (isinstance(self.on_failure, (int, float)) and math.isfinite(self.on_failure)):
            raise ConfigError(f"reward.on_failure={self.on_failure!r}: must be a finite number")


@dataclass(kw_only=True)
class EnvConfig:
    """A multi-turn environment (`--env module:Class`, tasks/episodes.py): its episodes' bounds."""

    max_turns: int = 4
    """Policy turns per episode (each up to rollout.max_tokens tokens, ending at a stop id)."""
    max_tokens: int = 0
    """Tokens after the prompt per episode, turns and observations together; 0: no limit beyond the turns'."""

    def __post_init__(self):
        check_ints(self, "env", ("max_turns",))
        check_ints(self, "env", ("max_tokens",), low=0, words="an integer >= 0")
