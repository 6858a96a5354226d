"""A merged Hugging Face model: each adapted projection's weight W + (alpha / r) B A, computed in
float64 and stored in the base's dtype; every other tensor copied. `family`: the base's record (the
registry's, handed in by the caller)."""

from __future__ import annotations

from pathlib import Path

import torch

from longstraw_mcore.adapters.peft_io import read_peft
from longstraw_mcore.checkpoint.hf import SafetensorsDir, write_hf
from longstraw_mcore.config import AdapterConfig


def merge_into_hf(family, base_dir: str | Path, adapter_dir: str | Path, dst: str | Path, log=print) -> int:
    """Write `dst` = the base directory with the adapter merged; returns the number of merged weights."""
    mapping = family.checkpoint
    m, raw = mapping.read_config(base_dir)
    cfg, adapter = read_peft(adapter_dir, mapping.adapter_sites(m), AdapterConfig())
    tensors = SafetensorsDir(base_dir, mapping.tensor_name)
    out = {}
    for name in tensors:
        w = tensors[name]
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module in adapter:
            A, B = adapter[module]
            w = (w.to(torch.float64) + cfg.scale * B @ A).to(w.dtype)
        out[name] = w
    merged = sum(1 for n in tensors if n.endswith(".weight") and n[:-7] in adapter)
    write_hf(dst, out, raw if mapping.config_is_decoder_only(raw) else mapping.hf_config_dict(m))
    log(f"[merge] {dst}: {merged} weights merged (r={cfg.rank}, alpha={cfg.alpha:g}), {len(out)} tensors")
    return merged
