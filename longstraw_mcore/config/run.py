"""Everything one `longstraw` invocation needs: the model (one of the families' configs), the layout,
the run sections, the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from longstraw_mcore.config.adapter import AdapterConfig, CriticAdapterConfig
from longstraw_mcore.config.errors import ConfigError, check_choices
from longstraw_mcore.config.glm5_next import Glm5NextConfig
from longstraw_mcore.config.glm_dsa import GlmDsaConfig
from longstraw_mcore.config.layout import ParallelConfig
from longstraw_mcore.config.memory import MemoryConfig
from longstraw_mcore.config.ppo import PPOConfig
from longstraw_mcore.config.qwen3_5 import Qwen35Config
from longstraw_mcore.config.sections import (GRPOConfig, OpsConfig, ReplayConfig, RolloutConfig, TaskConfig,
                                             TrainConfig)
from longstraw_mcore.config.user_task import DatasetConfig, EnvConfig, RewardConfig

ModelConfig = Qwen35Config | GlmDsaConfig | Glm5NextConfig
"""A model of any family (the annotation every family-neutral module uses)."""

MODEL_CONFIGS = {"qwen3_5": Qwen35Config, "glm_dsa": GlmDsaConfig, "glm5_next": Glm5NextConfig}
"""`model.family` -> its config class (adding a family adds a line here)."""


@dataclass(kw_only=True)
class RunConfig:
    """Everything one `longstraw` invocation needs."""

    model: ModelConfig
    """The model; its `family` key picks the dataclass (qwen3_5 when absent)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    critic_adapter: CriticAdapterConfig = field(default_factory=CriticAdapterConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """`cpu` (gloo), `cuda` (NCCL), or `auto`: cuda when available."""
    seed: int = 1234

    def __post_init__(self) -> None:
        check_choices(self, "")
        self.model.check_layout(self.parallel)
        self.memory.check_run(self.replay.mode, self.model.dtype, self.train.grad_reduction, self.device)
        self.adapter.check_against(self.model.projection_shapes(), self.model.family)
        self.critic_adapter.check_against(self.model.projection_shapes(), self.model.family)
        if self.replay.reuse_steps > 1 and self.adapter.prompt != "frozen":
            raise ConfigError(f"replay.reuse_steps={self.replay.reuse_steps}: one capture serves several optimizer "
                              "steps only when the prompt state does not depend on trainable weights; set "
                              "adapter.prompt=frozen (with adapter.rank > 0), or replay.reuse_steps=1")
        if self.parallel.vpp > 1:
            why = ("grpo.objective=ppo (the critic is built as one model chunk per rank)" if self.grpo.objective == "ppo"
                   else "Megatron's distributed optimizer (train.distributed_optimizer, or memory.optimizer_offload "
                        "under train.grad_reduction=step)" if self.uses_distributed_optimizer() else None)
            if why is not None:
                raise ConfigError(f"parallel.vpp={self.parallel.vpp}: interleaved stages run with Megatron's plain "
                                  f"optimizer or train.grad_reduction=micro_step, not yet with {why}; use "
                                  "parallel.vpp=1 or leave that setting out")
        bad = [t for t in self.rollout.stop_ids if t >= self.model.vocab_size]
        if bad:
            raise ConfigError(f"rollout.stop_ids={self.rollout.stop_ids}: {bad} not below model.vocab_size="
                              f"{self.model.vocab_size}")

    def uses_distributed_optimizer(self) -> bool:
        """train.distributed_optimizer, or memory.optimizer_offload under train.grad_reduction=step:
        Megatron-Core 0.19's HybridDeviceOptimizer works only inside its DistributedOptimizer (inside the
        mixed-precision optimizer its parameter map misses the float32 copies that optimizer swaps in:
        KeyError at the first step, seen on an H200)."""
        offload_step = self.memory.optimizer_offload and self.train.grad_reduction == "step"
        return self.train.distributed_optimizer or offload_step

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
