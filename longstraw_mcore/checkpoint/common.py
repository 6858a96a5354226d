"""What every checkpoint format and family shares: the error type, shape lookup without reading, and
the preamble of reading a Hugging Face `config.json` (present, valid JSON, an architecture the family
reads, a dtype the configs accept)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import get_args

from longstraw_mcore.config.model_base import DType

DTYPE_NAMES = get_args(DType)
CONFIG_FILE = "longstraw_model.json"  # (marks a longstraw Megatron checkpoint's step directory)
"""The dtypes a checkpoint may be stored in (config.json's `dtype` / `torch_dtype`)."""


class CheckpointError(ValueError):
    """A checkpoint does not match the model (names the tensor and the expected/actual shapes), or a
    checkpoint directory is damaged (names the file)."""


def shape_of(tensors: Mapping, key: str) -> tuple[int, ...]:
    """Shape without reading data when the mapping can tell it (lazy checkpoint readers)."""
    return tuple(tensors.shape(key)) if hasattr(tensors, "shape") else tuple(tensors[key].shape)


def read_config_json(path: str | Path, architectures: tuple[str, ...] | None = None) -> tuple[dict, Path]:
    """(raw config.json, its path) of a Hugging Face directory; with `architectures`, one of them must
    be named. Raises CheckpointError naming the file."""
    d = Path(path)
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d}: no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    archs = raw.get("architectures") or []
    if architectures is not None and not any(a in architectures for a in archs):
        raise CheckpointError(f"{d}: architecture {archs or raw.get('model_type')!r} is not supported; "
                              f"expected one of {list(architectures)}")
    return raw, f


def config_dtype(cfg_file: Path, *sections: dict) -> str:
    """The checkpoint dtype: the first `dtype` or `torch_dtype` of `sections` (bfloat16 when none names
    one), without a `torch.` prefix; refused unless the configs accept it."""
    dtype = "bfloat16"
    for sec in reversed(sections):
        dtype = sec.get("dtype", sec.get("torch_dtype", dtype))
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{cfg_file}: dtype {dtype!r} is not one of {list(DTYPE_NAMES)}")
    return dtype
