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
    `rules`, `hf_shapes`, `hf_to_mcore`, `mcore_to_hf`, `LazyCanonical`, `skipped_names`, `adapter_sites`; optionally
    `passthrough_names` (tensors beside the decoder that exports give back unchanged: checkpoint/passthrough.py)."""
    architectures: tuple[str, ...]
    layers: dict
    """Layer type (as `ModelConfig.layer_types` names it) -> its `LayerKind` record."""

    def build_rank(self, model_cfg, parallel, device: str, head: str = "lm"):
        """This rank's model: `build_model`'s, or at parallel.vpp > 1 the list of its model chunks (chunk v
        holds virtual stage v x pp + rank), which Megatron's interleaved schedule and the replay engine take."""
        if parallel.vpp == 1:
            return self.build_model(model_cfg, parallel, device, head=head)
        return [self.build_model(model_cfg, parallel, device, head=head, vp_stage=v) for v in range(parallel.vpp)]
