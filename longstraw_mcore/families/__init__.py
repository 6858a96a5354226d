"""Model-family registry: family name -> how to build, convert and replay it.

A family registers one `Family`: its spec builder (`build_model`), its Hugging Face config reader
and mapping table, the Hugging Face architectures it accepts, and the prompt-state kind of each of
its layer types. Everything family-specific is reached through `get_family(name)`, so adding a family
(GLM-5.2) adds files here and under models/ and checkpoint/, not edits across the tree. Families are
imported on first use; `build_model` imports Megatron only when called.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

_MODULES = {"qwen3_5": "longstraw_mcore.families.qwen3_5", "glm_dsa": "longstraw_mcore.families.glm_dsa"}


@dataclass(frozen=True)
class Family:
    name: str
    build_model: Callable
    """(ModelConfig, Parallel, device) -> this rank's model (its pipeline stage, its TP shard)."""
    read_hf_config: Callable
    """HF directory -> (ModelConfig, raw config.json dict); raises CheckpointError on a bad one."""
    mapping: object
    """Module with `hf_to_mcore`, `mcore_to_hf`, `hf_shapes`, `LazyCanonical`, `rules` (one table)."""
    architectures: tuple[str, ...]
    state_kinds: dict = field(default_factory=dict)
    """Layer type (as `ModelConfig.layer_types` names it) -> its `prompt_state` kind class."""


def get_family(name: str) -> Family:
    if name not in _MODULES:
        raise KeyError(f"model family {name!r} is not registered; known: {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[name]).FAMILY


def family_for_architectures(archs: list[str]) -> Family | None:
    """The family whose Hugging Face architectures include one of `archs` (config.json's list)."""
    for name in _MODULES:
        fam = get_family(name)
        if any(a in fam.architectures for a in archs):
            return fam
    return None


def known_architectures() -> list[str]:
    return [a for name in _MODULES for a in get_family(name).architectures]


def read_hf_config(path):
    """(ModelConfig, raw config.json) of a Hugging Face directory, by the family its architecture names."""
    import json
    from pathlib import Path

    from longstraw_mcore.checkpoint.common import CheckpointError

    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    archs = raw.get("architectures") or []
    fam = family_for_architectures(archs)
    if fam is None:
        raise CheckpointError(f"{path}: architecture {archs or raw.get('model_type')!r} is not supported; "
                              f"expected one of {known_architectures()}")
    return fam.read_hf_config(path)
