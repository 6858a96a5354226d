"""Tensors a Hugging Face directory holds beside the text decoder that must go back out unchanged on export, and
the config.json that describes them: a VLM's vision tower, where transformers has no text-only class for the
family (GLM-5.3-Flash: `Glm5NextForConditionalGeneration` only), so that an export must be the VLM's form.

The seam, family-neutral: a family's checkpoint module may define `passthrough_names(names, m) -> list[str]`, the
names (as its `tensor_name` gives them, which for these must be the stored names) of the tensors to keep. None of
them may be the decoder table's. A family without it (Qwen3.5/3.6, GLM-5.2) keeps nothing: its behaviour is
untouched.

Where they are kept, byte for byte in their own dtypes:
  - a converted Megatron checkpoint (checkpoint/convert.py `hf_to_mcore_dir`) and a full-parameter training step
    (`train --save`, `Session.save`) of a run from such a directory (`--hf`, `--load` or a resumed step): `FILE`
    beside Megatron's files, the original config.json recorded as `hf_config` in longstraw_model.json;
  - an exported Hugging Face directory (`mcore_to_hf_dir`, adapters/merge.py): beside the decoder's tensors in
    model.safetensors, under the family's `hf_config_dict(m, recorded)`.
A LoRA run's steps hold only the adapter: its merged export reads them from the base directory (adapters/merge.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from longstraw_mcore.checkpoint.common import CheckpointError

FILE = "hf_passthrough.safetensors"


def names(mapping, tensors: Mapping, m, where) -> list[str]:
    """The family's passthrough tensors among `tensors` (a reader's names), checked: present and not the decoder's."""
    fn = getattr(mapping, "passthrough_names", None)
    if fn is None:
        return []
    out = list(fn(list(tensors), m))
    decoder = sorted(set(out) & set(mapping.hf_shapes(m)))
    absent = [n for n in out if n not in tensors]
    if decoder or absent:
        raise CheckpointError(f"{where}: passthrough_names of {m.family} lists decoder tensor(s) {decoder[:5]} / "
                              f"tensor(s) not in the directory {absent[:5]}")
    return out


def write(directory: Path, tensors: Mapping, keep: list[str]) -> int:
    """`FILE` in `directory` (a temporary one, published whole by its caller's rename) holding `tensors[n]` for n
    in `keep`, bytes and dtypes as read. Returns the bytes of tensor data."""
    from safetensors.torch import save_file

    out = {n: tensors[n].contiguous() for n in keep}
    save_file(out, str(Path(directory) / FILE), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in out.values())


def read(directory: str | Path) -> dict[str, torch.Tensor]:
    """The passthrough tensors kept in a Megatron checkpoint directory ({} when it keeps none)."""
    from safetensors.torch import load_file

    f = Path(directory) / FILE
    return load_file(str(f)) if f.is_file() else {}


def recorded_config(mapping, raw: dict, kept: bool) -> dict | None:
    """The config.json to record beside a Megatron checkpoint: the original when it describes only the decoder (given
    back as is) or when tensors are kept with it (its other parts describe them); else None (written anew)."""
    return raw if kept or mapping.config_is_decoder_only(raw) else None


def export_config(mapping, m, recorded: dict | None) -> dict:
    """The config.json of an export: a recorded decoder-only one as is; a recorded one that describes more (the kept
    tensors) with its decoder's part replaced (`hf_config_dict(m, recorded)`); else `hf_config_dict(m)`."""
    if recorded is None:
        return mapping.hf_config_dict(m)
    if mapping.config_is_decoder_only(recorded):
        return recorded
    return mapping.hf_config_dict(m, recorded)


def add_to_export(hf: dict, kept: Mapping, where) -> dict:
    """The decoder's HF tensors with the kept ones beside them (a name in both: CheckpointError)."""
    both = sorted(set(hf) & set(kept))
    if both:
        raise CheckpointError(f"{where}: kept tensor(s) {both[:5]} are also the decoder's")
    return {**hf, **kept}


class Source:
    """Where a full-parameter run's kept tensors come from, copied into every step it saves: its `--hf` directory,
    the Megatron checkpoint of `--load`, and after each save (or a resume) that step's directory (the newest step
    survives train.keep_last). `config`: the recorded config.json."""

    def __init__(self, config: dict, file: Path | None = None, tensors: Mapping | None = None,
                 keep: list[str] | None = None):
        self.config, self.file, self.tensors, self.keep = config, file, tensors, keep

    @classmethod
    def of_hf(cls, family, path: str | Path, m) -> "Source | None":
        from longstraw_mcore.checkpoint.hf import read_tensors

        mapping = family.checkpoint
        if getattr(mapping, "passthrough_names", None) is None:
            return None
        _, raw = mapping.read_config(path)
        tensors, _ = read_tensors(path, mapping.tensor_name)
        keep = names(mapping, tensors, m, path)
        return cls(raw, tensors=tensors, keep=keep) if keep else None

    @classmethod
    def of_checkpoint(cls, path: str | Path) -> "Source | None":
        from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta

        f = Path(path) / FILE
        if not f.is_file():
            return None
        config = read_checkpoint_meta(path)[1].get("hf_config")
        if config is None:
            raise CheckpointError(f"{path}: holds {FILE} but no recorded hf_config (the config.json describing it)")
        return cls(config, file=f)

    def moved_to(self, step: Path) -> "Source":
        """The same tensors, read from now on from `step` (a directory `write_into` filled)."""
        return Source(self.config, file=Path(step) / FILE)

    def write_into(self, directory: Path) -> None:
        """`FILE` in `directory`: a hard link to the source's (a copy across file systems), or written from the
        Hugging Face directory."""
        dst = Path(directory) / FILE
        if self.file is None:
            write(directory, self.tensors, self.keep)
            return
        try:
            os.link(self.file, dst)
        except OSError:
            shutil.copyfile(self.file, dst)

    def items(self):
        """(name, tensor) of every kept tensor, read one at a time."""
        if self.file is None:
            for n in self.keep:
                yield n, self.tensors[n]
            return
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as fh:
            for n in fh.keys():
                yield n, fh.get_tensor(n)

    def names(self) -> list[str]:
        if self.file is None:
            return list(self.keep)
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as fh:
            return list(fh.keys())
