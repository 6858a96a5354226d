"""Checkpoint conversion: HF directory <-> Megatron distributed checkpoint, and HF straight into a model.

`hf_to_mcore_dir` validates everything (architecture, every tensor's presence and shape, that the
target layout divides the model) before it creates anything on disk, then writes a layout-free
Megatron checkpoint from one process with the tensors' own dtypes: HF -> Megatron -> HF is
bit-exact. The original `config.json` is recorded, so `mcore_to_hf_dir` gives it back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from longstraw_mcore.checkpoint.dist_ckpt import load_full_tensors, read_checkpoint_meta, save_full_tensors
from longstraw_mcore.checkpoint.full_state import load_full
from longstraw_mcore.checkpoint.hf import read_config, read_tensors, write_hf
from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError, LazyCanonical, hf_shapes, hf_to_mcore, mcore_to_hf
from longstraw_mcore.config import ConfigError, ModelConfig, ParallelConfig, validate_layout


def check_target_layout(m: ModelConfig, tp: int, pp: int) -> None:
    validate_layout(m, ParallelConfig(tp=tp, pp=pp))
    if m.num_layers % pp:
        raise ConfigError(f"--pp {pp}: model.num_layers={m.num_layers} is not divisible by it")


def hf_to_mcore_dir(src: str | Path, dst: str | Path, tp: int = 1, pp: int = 1, log=print) -> dict:
    m, raw = read_config(src)
    check_target_layout(m, tp, pp)
    tensors, skipped = read_tensors(src)
    canonical = hf_to_mcore(tensors, m, where=str(src))
    unused = sorted(set(tensors) - set(hf_shapes(m)))
    if unused:
        raise CheckpointError(f"{src}: tensor(s) {unused[:5]} are not part of a {m.family} text decoder of this "
                              "config (wrong config.json?)")
    text_only = "Qwen3_5ForCausalLM" in (raw.get("architectures") or [])
    if skipped:
        log(f"[convert] skipped {len(skipped)} tensors outside the text decoder "
            f"(vision tower / MTP), e.g. {skipped[:3]}")
    _init_cpu_process()
    save_full_tensors(canonical, dst, m, extra={"hf_config": raw if text_only else None, "source": str(src),
                                                "target_layout": {"tp": tp, "pp": pp}})
    nbytes = sum(t.numel() * t.element_size() for t in canonical.values())
    log(f"[convert] wrote {len(canonical)} tensors ({nbytes / 2**30:.3f} GiB) to {dst}; loads at any tp/pp "
        f"(checked for tp={tp}, pp={pp})")
    return {"tensors": len(canonical), "bytes": nbytes, "skipped": skipped}


def mcore_to_hf_dir(src: str | Path, dst: str | Path, log=print) -> dict:
    m, meta = read_checkpoint_meta(src)
    dstp = Path(dst)
    if dstp.exists() and any(dstp.iterdir()):
        raise CheckpointError(f"{dstp} exists and is not empty; refusing to overwrite")
    _init_cpu_process()
    hf = mcore_to_hf(load_full_tensors(src), m)
    write_hf(dstp, hf, m, config=meta.get("hf_config"))
    log(f"[convert] wrote {len(hf)} tensors to {dstp}")
    return {"tensors": len(hf)}


def _init_cpu_process() -> None:
    """Conversion is a one-process CPU job whatever the machine: Megatron's writer needs the CPU patches
    (it calls torch.cuda.synchronize) and a process group."""
    from longstraw_mcore import cpu_compat
    from longstraw_mcore.parallel.groups import init_distributed

    cpu_compat.enable("cpu")
    init_distributed("cpu")


def load_hf_into_model(model, src: str | Path, expect: ModelConfig | None = None, log=print) -> list[str]:
    """Load an HF directory into this rank's shard of `model` (converted in memory)."""
    m, _ = read_config(src)
    if expect is not None:
        _check_same_dims(m, expect, src)
    tensors, skipped = read_tensors(src)
    load_full(model, LazyCanonical(tensors, m, where=str(src)))  # reads each HF tensor once, on demand
    return skipped


def _check_same_dims(m: ModelConfig, expect: ModelConfig, src) -> None:
    ignore = {"dtype", "gdn_chunk_size"}
    a, b = dataclasses.asdict(m), dataclasses.asdict(expect)
    diff = {k: (a[k], b[k]) for k in a if k not in ignore and a[k] != b[k]}
    if diff:
        raise CheckpointError(f"{src}: checkpoint config differs from the run config: "
                              + ", ".join(f"{k}={v[0]} (config says {v[1]})" for k, v in diff.items()))

