"""Megatron distributed checkpoints (torch_dist format) of the model, with the model config recorded.

A checkpoint directory holds Megatron's files plus `longstraw_model.json` (model config and the
layout it was written from), so `mcore-to-hf` and `--load` need no other input. Checkpoints are
layout-free: one saved at any (tp, pp) loads at any other. Saving writes into a temporary sibling
and renames it into place on success; loading checks that the directory holds only data
(checkpoint/no_pickle.py) and every key and shape against the model before reading, and fails with the
file's or the tensor's name.

Call sites that save must run under `if __name__ == "__main__":` (Megatron's writer spawns a
process that re-imports `__main__`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from longstraw_mcore.checkpoint.full_state import expected_keys
from longstraw_mcore.checkpoint.common import CONFIG_FILE, CheckpointError
from longstraw_mcore.checkpoint.no_pickle import check_dcp, one_line_errors
from longstraw_mcore.config import ModelConfig, model_config_from_dict

FORMAT = "longstraw-mcore/1"


def _rank0_check(fn) -> None:
    """Run a check on rank 0 and raise the same error on every rank."""
    err = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on all ranks below
            err = f"{type(e).__name__}: {e}"
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])


def _prepare_dir(dst: Path, tmp: Path) -> None:
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; refusing to overwrite")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def _publish(dst: Path, tmp: Path, meta: dict) -> None:
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    if dst.exists():
        dst.rmdir()
    os.replace(tmp, dst)


def meta_dict(model_cfg: ModelConfig, layout: dict, extra: dict | None) -> dict:
    return {"format": FORMAT, "model": dataclasses.asdict(model_cfg), "layout": layout, **(extra or {})}


def write_model_shards(model, directory: str | Path) -> None:
    """Every rank writes its shards of `model` into the existing empty `directory` (collective)."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), str(directory))


def save_checkpoint(model, directory: str | Path, model_cfg: ModelConfig, layout: dict, extra: dict | None = None):
    """Save a (possibly TP/PP-sharded) model from every rank of the world."""
    dst = Path(directory).resolve()
    tmp = dst.parent / f".{dst.name}.partial"
    _rank0_check(lambda: _prepare_dir(dst, tmp))
    dist.barrier()
    write_model_shards(model, tmp)
    dist.barrier()
    _rank0_check(lambda: _publish(dst, tmp, meta_dict(model_cfg, layout, extra)))
    dist.barrier()
    return dst


def save_full_tensors(tensors: dict, directory: str | Path, model_cfg: ModelConfig, extra: dict | None = None,
                      files=None):
    """Save full canonical tensors from one process, dtypes untouched.

    Each tensor is one whole shard under its canonical key. The canonical layout *is* Megatron's
    global layout (including SwiGLU fc1 = [gate; up]), so the result loads at any tp/pp. `files(tmp)`:
    writes further files into the temporary directory before it is published (e.g. checkpoint/passthrough.py's)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if dist.get_world_size() != 1:
        raise RuntimeError(f"save_full_tensors writes from one process; this process group has "
                           f"{dist.get_world_size()} ranks (run the converter without torchrun)")
    dst = Path(directory).resolve()
    tmp = dst.parent / f".{dst.name}.partial"
    _prepare_dir(dst, tmp)
    try:
        sharded = {k: ShardedTensor.from_rank_offsets(k, t.contiguous(), replica_id=0) for k, t in tensors.items()}
        dist_checkpointing.save(sharded, str(tmp))
        if files is not None:
            files(tmp)
        _publish(dst, tmp, meta_dict(model_cfg, {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "world_size": 1}, extra))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load_full_tensors(directory: str | Path) -> dict:
    """Every tensor of a checkpoint, full, in its stored dtype (one process)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    check_dcp(directory)
    with one_line_errors(directory):
        stored = dist_checkpointing.load_tensors_metadata(str(directory))
        request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(v.global_shape), dtype=v.dtype),
                                                      replica_id=0) for k, v in stored.items()}
        return dict(dist_checkpointing.load(request, str(directory)))


def read_checkpoint_meta(directory: str | Path) -> tuple[ModelConfig, dict]:
    d = Path(directory)
    f = d / CONFIG_FILE
    if not f.is_file():
        raise CheckpointError(f"{d}: no {CONFIG_FILE}; not a longstraw-mcore Megatron checkpoint")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return model_config_from_dict(meta["model"]), meta


def check_against_model(model, directory: str | Path) -> None:
    """Every tensor the model needs is in the checkpoint with the right global shape (vocabulary
    tensors: any padding that holds the true vocabulary; Megatron loads them with allow_shape_mismatch)."""
    from megatron.core import dist_checkpointing

    check_dcp(directory)  # (before Megatron unpickles anything of it: checkpoint/no_pickle.py)
    with one_line_errors(directory):
        stored = dist_checkpointing.load_tensors_metadata(str(directory))
    for key, (shape, true_rows) in expected_keys(model, with_true_rows=True).items():
        if key not in stored:
            raise CheckpointError(f"{directory}: checkpoint has no tensor {key!r}")
        got = tuple(stored[key].global_shape)
        ok = got == shape if true_rows is None else (got[1:] == shape[1:] and got[0] >= true_rows)
        if not ok:
            want = shape if true_rows is None else (f"({true_rows} or more, {', '.join(map(str, shape[1:]))})")
            raise CheckpointError(f"{directory}: tensor {key!r} has shape {got}, the model expects {want}")


def load_checkpoint(model, directory: str | Path) -> None:
    from megatron.core import dist_checkpointing

    from megatron.core.dist_checkpointing.validation import StrictHandling

    check_against_model(model, directory)
    # Layer `_extra_state` objects (Transformer Engine metadata; empty for the plain-torch layers) are
    # absent from checkpoints written from full tensors: skip those, refuse anything else missing.
    with one_line_errors(directory):
        state, missing_ckpt, _ = dist_checkpointing.load(model.sharded_state_dict(), str(directory),
                                                         strict=StrictHandling.RETURN_ALL)
    real = sorted(k for k in missing_ckpt if "_extra_state" not in k)
    if real:
        raise CheckpointError(f"{directory}: checkpoint lacks {real[:5]}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{directory}: loading left parameters unset: {missing[:5]}")
