"""What every checkpoint format and family shares: the error type and shape lookup without reading."""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointError(ValueError):
    """A checkpoint does not match the model (names the tensor and the expected/actual shapes), or a
    checkpoint directory is damaged (names the file)."""


def shape_of(tensors: Mapping, key: str) -> tuple[int, ...]:
    """Shape without reading data when the mapping can tell it (lazy checkpoint readers)."""
    return tuple(tensors.shape(key)) if hasattr(tensors, "shape") else tuple(tensors[key].shape)
