"""A merged Hugging Face model: each adapted projection's weight W + (alpha / r) B A, computed in
float64 and stored in the base's dtype; every other tensor copied. A family that keeps tensors beside the decoder
(checkpoint/passthrough.py: a VLM's vision tower) gets the decoder's and those, under its `hf_config_dict(m, the
base's config.json)`, as `mcore_to_hf_dir` writes them (anything else the reader keeps, e.g. MTP layers, left out);
any other family everything its reader keeps. `family`: the base's record (the registry's, handed in by the
caller)."""

from __future__ import annotations

from pathlib import Path

import torch

from longstraw_mcore.adapters.peft_io import read_peft
from longstraw_mcore.checkpoint import passthrough
from longstraw_mcore.checkpoint.hf import SafetensorsDir, write_hf
from longstraw_mcore.config import AdapterConfig


def merge_into_hf(family, base_dir: str | Path, adapter_dir: str | Path, dst: str | Path, log=print) -> int:
    """Write `dst` = the base directory with the adapter merged; returns the number of merged weights."""
    mapping = family.checkpoint
    m, raw = mapping.read_config(base_dir)
    sites = mapping.adapter_sites(m)
    cfg, adapter = read_peft(adapter_dir, sites, AdapterConfig())
    tensors = SafetensorsDir(base_dir, mapping.tensor_name)
    kept = passthrough.names(mapping, tensors, m, base_dir)
    names = list(tensors)
    if kept:
        shapes, kept_set = mapping.hf_shapes(m), set(kept)
        names = [n for n in names if n in shapes or n in kept_set]
    # each adapted module's stored weight: `<module>.weight`, or the site's own name for it (Site.weight)
    stored = {s.name: s.weight for s in sites if s.weight is not None}
    module_of = {stored.get(mod, f"{mod}.weight"): mod for mod in adapter}
    out = {}
    for name in names:
        w = tensors[name]
        if name in module_of:
            A, B = adapter[module_of[name]]
            w = (w.to(torch.float64) + cfg.scale * B @ A).to(w.dtype)
        out[name] = w
    merged = sum(1 for n in tensors if n in module_of)
    write_hf(dst, out, passthrough.export_config(mapping, m, passthrough.recorded_config(mapping, raw, bool(kept))))
    log(f"[merge] {dst}: {merged} weights merged (r={cfg.rank}, alpha={cfg.alpha:g}), {len(out)} tensors")
    return merged
