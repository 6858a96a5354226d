"""Megatron distributed checkpoints (torch_dist format) of the model, with the model config recorded.

A checkpoint directory holds Megatron's files plus `longstraw_model.json` (model config and the
layout it was written from), so `mcore-to-hf` and `--load` need no other input. Checkpoints are
layout-free: one saved at any (tp, pp) loads at any other. Saving writes into a temporary sibling
and renames it into place on success; loading checks every key and shape against the model before
reading, and fails with the tensor's name.

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
from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError
from longstraw_mcore.config import ModelConfig, model_config_from_dict

CONFIG_FILE = "longstraw_model.json"
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


def save_checkpoint(model, directory: str | Path, model_cfg: ModelConfig, layout: dict, extra: dict | None = None):
    from megatron.core import dist_checkpointing

    dst = Path(directory).resolve()
    tmp = dst.parent / f".{dst.name}.partial"

    def prepare():
        if dst.exists() and any(dst.iterdir()):
            raise CheckpointError(f"{dst} exists and is not empty; refusing to overwrite")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    _rank0_check(prepare)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp))
    dist.barrier()

    def publish():
        meta = {"format": FORMAT, "model": dataclasses.asdict(model_cfg), "layout": layout, **(extra or {})}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)

    _rank0_check(publish)
    dist.barrier()
    return dst


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
    """Every tensor the model needs is in the checkpoint with the right global shape."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    for key, shape in expected_keys(model).items():
        if key not in stored:
            raise CheckpointError(f"{directory}: checkpoint has no tensor {key!r}")
        got = tuple(stored[key].global_shape)
        if got != shape:
            raise CheckpointError(f"{directory}: tensor {key!r} has shape {got}, the model expects {shape}")


def load_checkpoint(model, directory: str | Path) -> None:
    from megatron.core import dist_checkpointing

    check_against_model(model, directory)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{directory}: loading left parameters unset: {missing[:5]}")
