"""Move between full (unsharded, canonical-key) tensors and a model's TP/PP-local shards.

The model's own `sharded_state_dict()` says where each local tensor sits in the global one
(`ShardedTensor.global_offset`, or a `ShardedTensorFactory` such as Megatron's SwiGLU fc1 layout),
so one mechanism serves every layer type, including ours; no per-layer slicing rules are repeated
here.
- `load_full` writes this rank's slices, reading only those slices from a source that can read
  slices (a lazy Hugging Face directory reads just the rank's rows/columns from safetensors);
- `stream_full` hands full tensors (parameters or gradients) to one rank, one key at a time, gathered
  in buckets of a bounded size (validation dumps of a large model: no rank ever holds more than one
  bucket, 256 MiB by default or one larger tensor, plus its own shards);
- `gather_full` assembles every full tensor on every rank (tests and small models).
Vocabulary tensors are padded in the model (Megatron's `make_vocab_size_divisible_by`; their
sharded tensors carry `allow_shape_mismatch`): full tensors here always have the *true* vocabulary
(`model.vocab_size` rows), padded rows are zero-filled on load and dropped on gather.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                                      is_main_replica)


def _entries(model) -> list[ShardedTensor | ShardedTensorFactory]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return [v for v in nested_values(model.sharded_state_dict()) if not isinstance(v, ShardedObject)]


def _slices(sh: ShardedTensor) -> tuple[slice, ...]:
    """Where this piece sits in the full tensor. Prepended axes are real axes of it (our layers are
    keyed one by one, so the only prepended axis is a SequentialMLP's expert index): one index each."""
    assert sh.flattened_range is None, f"{sh.key}: flattened shards are not supported here"
    p = sh.prepend_axis_num
    return tuple(slice(o, o + 1) for o in sh.global_offset[:p]) + \
        tuple(slice(o, o + n) for o, n in zip(sh.global_offset[p:], sh.local_shape))


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


def _true_rows(model, leaf) -> int | None:
    """Rows of the unpadded tensor for a padded (vocabulary) leaf; None for every other leaf (a critic's or
    reward model's scalar head, models/heads.py, is not padded, though Megatron marks `output_layer` so)."""
    from longstraw_mcore.checkpoint.heads import head_of_model

    if not getattr(leaf, "allow_shape_mismatch", False):
        return None
    if head_of_model(model) != "lm" and leaf.key.startswith("output_layer."):
        return None
    return int(model.vocab_size)


def _global_shape(model, leaf) -> tuple[int, ...]:
    shape = tuple(leaf.global_shape)
    rows = _true_rows(model, leaf)
    return shape if rows is None else (rows,) + shape[1:]


def expected_keys(model, with_true_rows: bool = False) -> dict:
    """Canonical key -> global shape (padded) of every tensor this rank holds a piece of; with
    `with_true_rows`, key -> (padded shape, true row count or None)."""
    out = {}
    for e in _entries(model):
        for leaf in _leaves(e)[0]:
            shape = tuple(leaf.global_shape)
            out[leaf.key] = (shape, _true_rows(model, leaf)) if with_true_rows else shape
    return out


def read_slice(full, key: str, sl: tuple[slice, ...]) -> torch.Tensor:
    """`full[key][sl]`, read as a slice when the source can (lazy checkpoint readers)."""
    return full.read(key, sl) if hasattr(full, "read") else full[key][sl]


def _local_piece(full, key: str, sl: tuple[slice, ...], rows: int | None, like: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full tensor of `rows` true rows; rows past them (padding) are zeros."""
    if rows is None or sl[0].stop <= rows:
        return read_slice(full, key, sl)
    piece = torch.zeros(tuple(s.stop - s.start for s in sl), dtype=like.dtype)
    if sl[0].start < rows:
        have = read_slice(full, key, (slice(sl[0].start, rows),) + sl[1:])
        piece[:rows - sl[0].start] = have.to(piece.dtype)
    return piece


@torch.no_grad()
def load_full(model, full) -> None:
    """Copy this rank's slices of `full` (canonical key -> full tensor; a dict, or a lazy mapping with
    `.shape(key)` and optionally `.read(key, slices)`) into the model's parameters.

    Every key/shape is checked before anything is written, so a bad checkpoint leaves the model as it was."""
    from longstraw_mcore.checkpoint.common import CheckpointError, shape_of

    entries = _entries(model)
    plan = []
    for e in entries:
        leaves, merge = _leaves(e)
        for leaf in leaves:
            if leaf.key not in full:
                raise CheckpointError(f"checkpoint has no tensor {leaf.key!r} (needed by this model)")
            gshape = _global_shape(model, leaf)
            if shape_of(full, leaf.key) != gshape:
                raise CheckpointError(f"tensor {leaf.key!r} has shape {shape_of(full, leaf.key)}, the model "
                                      f"expects {gshape}")
        plan.append((e, leaves, merge))
    for e, leaves, merge in plan:
        local = merge([_local_piece(full, leaf.key, _slices(leaf), _true_rows(model, leaf), e.data)
                       .reshape(leaf.local_shape) for leaf in leaves])
        e.data.copy_(local.to(e.data.dtype))


def _pieces(model, grads: bool, main_only: bool) -> list[tuple[str, tuple[int, ...], tuple[slice, ...], torch.Tensor]]:
    """(key, true global shape, slices, local data) of this rank's pieces (gradients with `grads`)."""
    out = []
    for e in _entries(model):
        t = e.data
        if grads:
            t = getattr(t, "main_grad", None) if getattr(t, "grad", None) is None else t.grad
            if t is None:
                t = torch.zeros_like(e.data)
        leaves, _ = _leaves(e)
        if isinstance(e, ShardedTensorFactory):
            data = [bl.data for bl in _leaves(ShardedTensorFactory(e.key, t, e.build_fn, e.merge_fn, e.replica_id,
                                                                   e.flattened_range))[0]]
        else:
            data = [t]
        for leaf, d in zip(leaves, data):
            if main_only and not is_main_replica(leaf.replica_id):
                continue
            sl = _slices(leaf)
            rows = _true_rows(model, leaf)
            if rows is not None:  # drop padded rows
                keep = max(0, min(sl[0].stop, rows) - sl[0].start)
                d, sl = d[:keep], (slice(sl[0].start, sl[0].start + keep),) + sl[1:]
            out.append((leaf.key, _global_shape(model, leaf), sl, d.detach()))
    return out


def _assemble(pieces) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for key, gshape, sl, data in pieces:
        if key not in out:
            out[key] = torch.zeros(gshape, dtype=data.dtype)
            covered[key] = torch.zeros(gshape, dtype=torch.bool)
        out[key][sl] = data.cpu()
        covered[key][sl] = True
    holes = [k for k, c in covered.items() if not bool(c.all())]
    assert not holes, f"no rank holds some elements of {holes[:3]}: the gathered tensors would be incomplete"
    return out


def _wire(d: torch.Tensor):
    """A tensor as (dtype, shape, bytes as a numpy array) for the object collectives: numpy arrays pickle
    as one buffer, where a tensor goes through torch.save / a safe torch.load per piece (thousands of
    pieces: most of a 78-layer dump's time). Any dtype (bfloat16 included) travels as raw bytes."""
    d = d.detach().cpu().contiguous()
    return d.dtype, tuple(d.shape), d.reshape(-1).view(torch.uint8).numpy()


def _unwire(w) -> torch.Tensor:
    dtype, shape, raw = w
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def gather_full(model, grads: bool = False, group=None) -> dict[str, torch.Tensor]:
    """Full tensors (params, or their gradients with `grads=True`) on every rank of `group` (default: world).

    Pieces travel with `all_gather_object`: meant for tests and small models (`stream_full` otherwise)."""
    pieces = [(k, s, sl, d.cpu()) for k, s, sl, d in _pieces(model, grads, main_only=False)]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [(k, s, sl, _wire(d)) for k, s, sl, d in pieces], group=group)
        pieces = [(k, s, sl, _unwire(w)) for rank_pieces in gathered for k, s, sl, w in rank_pieces]
    return _assemble(pieces)


def _buckets(keys: list[str], nbytes: dict[str, int], budget: int) -> list[list[str]]:
    """Consecutive keys grouped so that each group's full tensors total <= `budget` bytes (a larger
    tensor alone)."""
    out, cur, size = [], [], 0
    for k in keys:
        if cur and size + nbytes[k] > budget:
            out.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += nbytes[k]
    return out + ([cur] if cur else [])


def stream_full(model, grads: bool = False, dst: int = 0, order: list[str] | None = None,
                bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(canonical key, full tensor) one key at a time, the tensor on rank `dst` only (None elsewhere),
    in `order` (every key of the model, e.g. mapping-rule order) or the ranks' own order.

    Collective: every rank iterates to the end. Only main replicas send (a data-parallel or
    TP-replicated copy is not sent twice). Keys travel in buckets of consecutive keys whose full
    tensors total at most `bucket_bytes` (one gather per bucket, not per key: a 78-layer model has
    thousands of small tensors); rank `dst` holds one bucket's pieces at a time."""
    mine: dict[str, list] = {}
    for key, gshape, sl, d in _pieces(model, grads, main_only=True):
        mine.setdefault(key, []).append((gshape, sl, d))
    nbytes = {k: math.prod(v[0][0]) * v[0][2].element_size() for k, v in mine.items()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        keys = list(mine)
    else:
        every = [None] * world
        dist.all_gather_object(every, sorted(nbytes.items()))
        for rank_sizes in every:
            for k, b in rank_sizes:
                nbytes.setdefault(k, b)
        keys = list(dict.fromkeys(k for rank_sizes in every for k, _ in rank_sizes))  # one order on every rank
    if order is not None:
        assert set(order) == set(keys), f"order misses {sorted(set(keys) - set(order))[:3]}, " \
                                        f"has extra {sorted(set(order) - set(keys))[:3]}"
        keys = list(order)
    if world == 1:
        for key in keys:
            yield key, _assemble([(key, g, sl, d) for g, sl, d in mine[key]])[key]
        return
    rank = dist.get_rank()
    for bucket in _buckets(keys, nbytes, bucket_bytes):
        box = [None] * world if rank == dst else None
        dist.gather_object({k: [(g, sl, _wire(d)) for g, sl, d in mine.get(k, [])] for k in bucket}, box, dst=dst)
        for key in bucket:
            yield key, (_assemble([(key, g, sl, _unwire(w)) for ps in box for g, sl, w in ps[key]])[key]
                        if rank == dst else None)
