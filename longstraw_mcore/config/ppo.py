"""The `ppo` section: PPO with a critic (`grpo.objective=ppo`; loss/ppo.py). The policy clip is GRPO's
(`grpo.eps_low`, `grpo.eps_high`), the KL weight `grpo.beta` (a per-token reward term under PPO), the
aggregation `grpo.aggregation`."""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_mcore.config.errors import ConfigError


@dataclass(kw_only=True)
class PPOConfig:
    gamma: float = 1.0
    """GAE's discount, in [0, 1]."""
    lam: float = 0.95
    """GAE's lambda, in [0, 1]."""
    vf_coef: float = 0.5
    """Weight of the value loss (it trains the critic alone: a separate model)."""
    value_clip: float = 0.2
    """The value loss is clipped around the rollout's old values by this much (0: no clipping)."""
    whiten_advantages: bool = False
    """Advantages to mean 0, std 1 over the group's trained tokens before the policy loss."""
    critic_lr: float = 0.0
    """The critic's learning rate (0: train.lr). Its optimizer is otherwise train's (Adam, clip_grad)."""

    def __post_init__(self):
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ConfigError(f"ppo.{name}={v!r}: must be in [0, 1]")
        for name in ("vf_coef", "value_clip", "critic_lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ConfigError(f"ppo.{name}={v!r}: must be a number >= 0")
