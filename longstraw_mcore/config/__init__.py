"""Typed run configuration: model family + dimensions, parallel layout, run sections, device.

Configs are keyword-only dataclasses loaded from YAML (`configs/*.yaml`) and overridden with
`key=value` strings (`parallel.tp=2`, `model.dtype=float64`). Every field is validated where it is
declared; errors name the offending value and what would be valid. Nothing here imports torch at
module level or Megatron at all, so a bad config fails in milliseconds, before any process group,
allocation or write.

    errors.py      ConfigError and the shared checks (choices come from the `Literal` annotations)
    model_base.py  what every family's model config derives alike (vocabulary padding, torch dtype)
    qwen3_5.py     Qwen35Config: the Qwen3.5/3.6 hybrid's dimensions and the layouts it splits over
    glm_dsa.py     GlmDsaConfig: GLM-5.x's dimensions and layouts; glm_5_2() its real dimensions
    glm5_next.py   Glm5NextConfig: GLM-5.3-Flash's (KDA + MLA/DSA + MoE + streams); glm_5_3_flash()
    layout.py      ParallelConfig
    adapter.py     AdapterConfig: LoRA / QLoRA (adapters/); CriticAdapterConfig: the same on PPO's critic
    memory.py      MemoryConfig: recompute, state offload / fp8, optimizer offload, MLA query blocks
    sections.py    replay, grpo, rollout, ops, task, train
    ppo.py         PPOConfig: GAE, the value loss, the critic's learning rate (grpo.objective=ppo)
    user_task.py   dataset, reward, env: the user's own task (--dataset, --reward, --env)
    run.py         RunConfig; ModelConfig (any family's); the family -> config class table
    loader.py      YAML + key=value overrides
"""

from longstraw_mcore.config.adapter import AdapterConfig
from longstraw_mcore.config.errors import ConfigError
from longstraw_mcore.config.glm5_next import Glm5NextConfig, glm_5_3_flash
from longstraw_mcore.config.glm_dsa import GlmDsaConfig, glm_5_2
from longstraw_mcore.config.layout import ParallelConfig
from longstraw_mcore.config.memory import MemoryConfig
from longstraw_mcore.config.ppo import PPOConfig
from longstraw_mcore.config.loader import apply_overrides, config_to_dict, load_config, model_config_from_dict
from longstraw_mcore.config.qwen3_5 import Qwen35Config
from longstraw_mcore.config.user_task import DatasetConfig, EnvConfig, RewardConfig
from longstraw_mcore.config.run import MODEL_CONFIGS, ModelConfig, RunConfig
from longstraw_mcore.config.sections import (GRPOConfig, OpsConfig, ReplayConfig, RolloutConfig, TaskConfig,
                                             TrainConfig)

__all__ = ["AdapterConfig", "MemoryConfig", "ConfigError", "ModelConfig", "Qwen35Config", "GlmDsaConfig", "glm_5_2",
           "Glm5NextConfig", "glm_5_3_flash", "ParallelConfig", "ReplayConfig", "GRPOConfig", "PPOConfig",
           "RolloutConfig", "OpsConfig", "TaskConfig", "TrainConfig", "RunConfig", "MODEL_CONFIGS", "DatasetConfig",
           "RewardConfig", "EnvConfig", "load_config", "apply_overrides", "config_to_dict", "model_config_from_dict"]
