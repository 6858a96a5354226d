"""Move between full (unsharded, canonical-key) tensors and a model's TP/PP-local shards.

The model's own `sharded_state_dict()` says where each local tensor sits in the global one
(`ShardedTensor.global_offset`, or a `ShardedTensorFactory` such as Megatron's SwiGLU fc1 layout),
so one mechanism serves every layer type, including ours; no per-layer slicing rules are repeated
here. `load_full` writes this rank's slices; `gather_full` assembles full tensors of the parameters
(or of their gradients) on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory


def _entries(model) -> list[ShardedTensor | ShardedTensorFactory]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return [v for v in nested_values(model.sharded_state_dict()) if not isinstance(v, ShardedObject)]


def _slices(sh: ShardedTensor) -> tuple[slice, ...]:
    assert sh.flattened_range is None, f"{sh.key}: flattened shards are not supported here"
    offs = sh.global_offset[sh.prepend_axis_num:]
    return tuple(slice(o, o + n) for o, n in zip(offs, sh.local_shape))


def _leaves(entry):
    """(ShardedTensor leaves, merge) for an entry; merge(list of local tensors) -> the local tensor."""
    if isinstance(entry, ShardedTensorFactory):
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        built = entry.build()
        leaves = list(nested_values(built))

        def merge(tensors, built=built):
            it = iter(tensors)

            def fill(x):
                if isinstance(x, dict):
                    return {k: fill(v) for k, v in x.items()}
                if isinstance(x, list):
                    return [fill(v) for v in x]
                return next(it)

            return entry.merge_fn(fill(built))

        return leaves, merge
    return [entry], lambda ts: ts[0]


def expected_keys(model) -> dict[str, tuple[int, ...]]:
    """Canonical key -> global shape of every tensor this rank holds a piece of."""
    out = {}
    for e in _entries(model):
        for leaf in _leaves(e)[0]:
            out[leaf.key] = tuple(leaf.global_shape[leaf.prepend_axis_num:])
    return out


@torch.no_grad()
def load_full(model, full) -> None:
    """Copy this rank's slices of `full` (canonical key -> full tensor; a dict or a lazy mapping with
    `.shape(key)`, read key by key) into the model's parameters.

    Every key/shape is checked before anything is written, so a bad checkpoint leaves the model as it was."""
    from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError, shape_of

    entries = _entries(model)
    plan = []
    for e in entries:
        leaves, merge = _leaves(e)
        for leaf in leaves:
            if leaf.key not in full:
                raise CheckpointError(f"checkpoint has no tensor {leaf.key!r} (needed by this model)")
            gshape = tuple(leaf.global_shape[leaf.prepend_axis_num:])
            if shape_of(full, leaf.key) != gshape:
                raise CheckpointError(f"tensor {leaf.key!r} has shape {shape_of(full, leaf.key)}, the model "
                                      f"expects {gshape}")
        plan.append((e, leaves, merge))
    for e, leaves, merge in plan:
        local = merge([full[leaf.key][_slices(leaf)] for leaf in leaves])
        e.data.copy_(local.to(e.data.dtype))


def gather_full(model, grads: bool = False, group=None) -> dict[str, torch.Tensor]:
    """Full tensors (params, or their gradients with `grads=True`) on every rank of `group` (default: world).

    Pieces travel with `all_gather_object`: meant for tests, validation dumps and small models."""
    pieces = []
    for e in _entries(model):
        t = e.data
        if grads:
            t = getattr(t, "main_grad", None) if getattr(t, "grad", None) is None else t.grad
            if t is None:
                t = torch.zeros_like(e.data)
        leaves, _ = _leaves(e)
        if isinstance(e, ShardedTensorFactory):
            built_leaves = _leaves(ShardedTensorFactory(e.key, t, e.build_fn, e.merge_fn, e.replica_id,
                                                        e.flattened_range))[0]
        else:
            built_leaves = [leaves[0]]
        for leaf, bl in zip(leaves, built_leaves):
            data = bl.data if isinstance(e, ShardedTensorFactory) else t
            pieces.append((leaf.key, tuple(leaf.global_shape[leaf.prepend_axis_num:]), _slices(leaf),
                           data.detach().cpu()))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, pieces, group=group)
        pieces = [p for rank_pieces in gathered for p in rank_pieces]
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for key, gshape, sl, data in pieces:
        if key not in out:
            out[key] = torch.zeros(gshape, dtype=data.dtype)
            covered[key] = torch.zeros(gshape, dtype=torch.bool)
        out[key][sl] = data
        covered[key][sl] = True
    holes = [k for k, c in covered.items() if not bool(c.all())]
    assert not holes, f"no rank holds some elements of {holes[:3]}: the gathered tensors would be incomplete"
    return out
