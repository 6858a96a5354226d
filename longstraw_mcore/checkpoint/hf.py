"""Hugging Face model directories (`config.json` + `*.safetensors`), any family: tensors read lazily
(a rank reads only its slices), directories written atomically (a temporary sibling renamed into
place, so a failed write never leaves a half-written checkpoint). What a family's `config.json`
holds, and which stored tensors belong to its decoder, are the family's (checkpoint/<family>.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import torch

from longstraw_mcore.checkpoint.common import CheckpointError


class SafetensorsDir(Mapping):
    """The tensors of an HF directory, read on access (one tensor at a time), or only a slice of one
    (`read`: a TP rank reads its shard); shapes come from the file headers without reading data.
    `name(key)` (a family's): the name a stored key is known by, or None to set it aside (`skipped`);
    default: the stored names. `bytes_read` counts what was read."""

    def __init__(self, path: str | Path, name: Callable[[str], str | None] | None = None):
        from safetensors import safe_open

        d = Path(path)
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors files")
        self._where: dict[str, tuple[str, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.skipped: list[str] = []
        self.bytes_read = 0
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    known = key if name is None else name(key)
                    if known is None:
                        self.skipped.append(key)
                        continue
                    self._where[known] = (str(f), key)
                    self._shapes[known] = tuple(fh.get_slice(key).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, key = self._where[name]
        with safe_open(f, framework="pt") as fh:
            t = fh.get_tensor(key)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read(self, name: str, sl: tuple[slice, ...]) -> torch.Tensor:
        """Only `tensor[sl]` of `name` (contiguous slices per dimension) is read from disk."""
        from safetensors import safe_open

        f, key = self._where[name]
        with safe_open(f, framework="pt") as fh:
            t = fh.get_slice(key)[tuple(sl)]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_tensors(path: str | Path, name: Callable[[str], str | None] | None = None) -> tuple[SafetensorsDir, list[str]]:
    """The tensors of an HF directory (lazy; named by `name`, see SafetensorsDir) and the skipped keys."""
    tensors = SafetensorsDir(path, name)
    return tensors, tensors.skipped


def write_dir_atomically(path: str | Path, fill: Callable[[Path], None], error=CheckpointError) -> Path:
    """Create directory `path` whole or not at all: `fill(tmp)` writes a temporary sibling, which is then
    renamed into place (removed if anything fails). Refuses (`error`) to overwrite a non-empty directory."""
    dst = Path(path)
    if dst.exists() and any(dst.iterdir()):
        raise error(f"{dst}: exists and is not empty; refusing to overwrite")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp", dir=dst.parent))
    try:
        fill(tmp)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def write_hf(path: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write config.json (`config`: the family's, checkpoint/<family>.py `hf_config_dict`) +
    model.safetensors atomically (temp dir, then rename). Refuses to overwrite a non-empty directory."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return write_dir_atomically(path, fill)
