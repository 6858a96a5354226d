"""Model-family registry: family name (or Hugging Face architecture) -> its record.

A family registers one `Family` (families/record.py) in families/<name>.py: its config class (config/<name>.py), its model
builder (models/<name>.py; Megatron is imported only when called), its checkpoint table with its
`config.json` read/write (checkpoint/<name>.py), the Hugging Face architectures it accepts, and one
record per layer type (prompt_state/kinds.py: state kind, activation bytes, FLOPs).

The registry is consulted only from the top: the command line (commands/), the tools and the tests
pick a family here and hand the record, or what it holds, to the library below (the model builder
hands the layer records to the model, the planner and the converter take the record), so no lower
module imports this package (tests/unit/test_imports.py checks it). Families are imported on first use.
"""

from __future__ import annotations

import importlib

from longstraw_mcore.families.record import Family

_MODULES = {"qwen3_5": "longstraw_mcore.families.qwen3_5", "glm_dsa": "longstraw_mcore.families.glm_dsa",
            "glm5_next": "longstraw_mcore.families.glm5_next"}


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


def family_of_dir(path) -> Family:
    """The family of a Hugging Face directory, by the architecture its config.json names."""
    from longstraw_mcore.checkpoint.common import CheckpointError, read_config_json

    raw, _ = read_config_json(path)
    archs = raw.get("architectures") or []
    fam = family_for_architectures(archs)
    if fam is None:
        raise CheckpointError(f"{path}: architecture {archs or raw.get('model_type')!r} is not supported; "
                              f"expected one of {known_architectures()}")
    return fam


def read_hf_config(path):
    """(ModelConfig, raw config.json) of a Hugging Face directory, by the family its architecture names."""
    return family_of_dir(path).checkpoint.read_config(path)
