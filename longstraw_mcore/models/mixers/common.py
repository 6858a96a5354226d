"""Helpers shared by the mixers: TP-sharded own parameters and their checkpoint description."""

from __future__ import annotations

import zlib

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)


def full_then_shard(shape: tuple[int, ...], fill, tp_rank: int, tp_size: int, dtype, seed: int, tag: str,
                    sharded: bool = True) -> torch.nn.Parameter:
    """Initialise the *full* tensor from a generator keyed by (seed, tag), keep this rank's dim-0 slice.

    The same full weights come out at every TP size, like Megatron's `use_cpu_initialization`."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(tag.encode())) % (2**63))
    full = fill(torch.empty(shape, dtype=torch.float64), gen)
    if sharded:
        n = shape[0] // tp_size
        full = full[tp_rank * n:(tp_rank + 1) * n]
    p = torch.nn.Parameter(full.to(dtype).contiguous())
    if sharded:
        set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
    return p


def sharded_state_dict_with_tp_params(module, tp_axis_map: dict[str, int], prefix: str, sharded_offsets,
                                      metadata, tp_group):
    """Megatron's default sharded state dict, except that `module`'s own parameters named in
    `tp_axis_map` are marked TP-sharded along the given axis (the default treats them as replicated)."""
    own: dict = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    out = make_sharded_tensors_for_checkpoint(own, prefix, tp_axis_map, sharded_offsets, tp_group=tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata,
                                              tp_group=tp_group))
    return out
