"""What a model family registers (families/__init__.py keeps the registry)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    config: type
    """Its model config class (`model.family` names it; config/run.py MODEL_CONFIGS maps the same)."""
    build_model: Callable
    """(ModelConfig, Parallel, device, head="lm") -> this rank's model (its pipeline stage, its TP shard);
    `head`: lm, token_value (a critic) or sequence_score (a reward model): models/heads.py."""
    checkpoint: ModuleType
    """checkpoint/<name>.py: `read_config`, `hf_config_dict`, `tensor_name`, `config_is_decoder_only`,
    `rules`, `hf_shapes`, `hf_to_mcore`, `mcore_to_hf`, `LazyCanonical`, `skipped_names`, `adapter_sites`."""
    architectures: tuple[str, ...]
    layers: dict
    """Layer type (as `ModelConfig.layer_types` names it) -> its `LayerKind` record."""
