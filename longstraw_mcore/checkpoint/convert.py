"""Checkpoint conversion: HF directory <-> Megatron distributed checkpoint, HF straight into a model,
and a model's tensors (or gradients) streamed out under Hugging Face names.

`hf_to_mcore_dir` validates everything (architecture, every tensor's presence and shape, that the
target layout divides the model) before it creates anything on disk, then writes a layout-free
Megatron checkpoint from one process with the tensors' own dtypes: HF -> Megatron -> HF is
bit-exact. The original `config.json` is recorded when it describes only the decoder, so `mcore_to_hf_dir`
gives it back; tensors the family keeps beside the decoder (a VLM's vision tower: `passthrough_names`,
checkpoint/passthrough.py) are stored beside the Megatron checkpoint with the config.json that describes
them, and written back bit for bit under it. Megatron
checkpoints written by training hold vocabulary tensors padded for their layout: the padding is
dropped on the way out (the true vocabulary is in the recorded model config). Family-specific parts
(config reader, mapping table: checkpoint/<family>.py) come with the family record the caller hands
in (families/: the command line and tools pick it, by a config.json's architecture or a config's
`model.family`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from longstraw_mcore.checkpoint import heads, passthrough
from longstraw_mcore.checkpoint.dist_ckpt import load_full_tensors, read_checkpoint_meta, save_full_tensors
from longstraw_mcore.checkpoint.full_state import load_full, stream_full
from longstraw_mcore.checkpoint.hf import read_tensors, write_hf
from longstraw_mcore.checkpoint.common import CheckpointError
from longstraw_mcore.config import ConfigError, ModelConfig, ParallelConfig


def check_target_layout(m: ModelConfig, tp: int, pp: int, ep: int = 1) -> None:
    m.check_layout(ParallelConfig(tp=tp, pp=pp, ep=ep))
    if m.num_layers % pp:
        raise ConfigError(f"--pp {pp}: model.num_layers={m.num_layers} is not divisible by it")


def _same_family(family, m: ModelConfig, where) -> None:
    if m.family != family.name:
        raise CheckpointError(f"{where}: holds a {m.family} model, not {family.name}")


def hf_to_mcore_dir(family, src: str | Path, dst: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                    log=print) -> dict:
    """`family`: the record of the directory's family (families/)."""
    mapping = family.checkpoint
    m, raw = mapping.read_config(src)
    check_target_layout(m, tp, pp, ep)
    tensors, skipped = read_tensors(src, mapping.tensor_name)
    canonical = mapping.hf_to_mcore(tensors, m, where=str(src))
    skipped = skipped + mapping.skipped_names(tensors, m)
    kept = passthrough.names(mapping, tensors, m, src)  # (not the decoder's: kept for export)
    unused = sorted(set(tensors) - set(mapping.hf_shapes(m)) - set(skipped) - set(kept))
    if unused:
        raise CheckpointError(f"{src}: tensor(s) {unused[:5]} are not part of a {m.family} text decoder of this "
                              "config (wrong config.json?)")
    kept_set = set(kept)
    dropped = [n for n in skipped if n not in kept_set]
    if dropped:
        log(f"[convert] skipped {len(dropped)} tensors outside the decoder "
            f"(vision tower / multi-token prediction), e.g. {dropped[:3]}")
    _init_cpu_process()
    # the original config.json goes back out if it describes only the decoder, or the kept tensors with it
    extra = {"hf_config": passthrough.recorded_config(mapping, raw, bool(kept)), "source": str(src),
             "target_layout": {"tp": tp, "pp": pp, "ep": ep}}

    def keep(tmp) -> None:
        n = passthrough.write(tmp, tensors, kept)
        log(f"[convert] kept {len(kept)} tensors beside the decoder for export ({n / 2**20:.1f} MiB, "
            f"{passthrough.FILE}), e.g. {kept[:3]}")

    save_full_tensors(canonical, dst, m, extra=extra, files=keep if kept else None)
    nbytes = sum(t.numel() * t.element_size() for t in canonical.values())
    log(f"[convert] wrote {len(canonical)} tensors ({nbytes / 2**30:.3f} GiB) to {dst}; loads at any tp/pp/ep "
        f"(checked for tp={tp}, pp={pp}, ep={ep})")
    return {"tensors": len(canonical), "bytes": nbytes, "skipped": skipped, "kept": kept}


def _unpad(hf: dict[str, torch.Tensor], shapes: dict) -> dict[str, torch.Tensor]:
    """Drop vocabulary padding: tensors with more rows than the HF shape (`shapes`), the rest equal."""
    out = {}
    for k, t in hf.items():
        want = shapes.get(k)
        if want is not None and tuple(t.shape) != want and t.shape[1:] == want[1:] and t.shape[0] > want[0]:
            t = t[:want[0]].contiguous()
        out[k] = t
    return out


def mcore_to_hf_dir(family, src: str | Path, dst: str | Path, log=print) -> dict:
    """`family`: the record of the checkpoint's `model.family` (read_checkpoint_meta tells it)."""
    m, meta = read_checkpoint_meta(src)
    _same_family(family, m, src)
    dstp = Path(dst)
    if dstp.exists() and any(dstp.iterdir()):
        raise CheckpointError(f"{dstp} exists and is not empty; refusing to overwrite")
    _init_cpu_process()
    mapping = family.checkpoint
    hf = _unpad(mapping.mcore_to_hf(load_full_tensors(src), m), mapping.hf_shapes(m))
    kept = passthrough.read(src)
    if kept and meta.get("hf_config") is None:
        raise CheckpointError(f"{src}: holds {passthrough.FILE} but no recorded hf_config (the config.json "
                              "describing its tensors)")
    config = passthrough.export_config(mapping, m, meta.get("hf_config"))
    write_hf(dstp, passthrough.add_to_export(hf, kept, src), config)
    log(f"[convert] wrote {len(hf)} decoder tensors" + (f" and {len(kept)} kept ones" if kept else "") + f" to {dstp}")
    return {"tensors": len(hf) + len(kept), "kept": len(kept)}


def _init_cpu_process() -> None:
    """Conversion is a one-process CPU job whatever the machine: Megatron's writer needs the CPU patches
    (it calls torch.cuda.synchronize) and a process group."""
    from longstraw_mcore import cpu_compat
    from longstraw_mcore.parallel.groups import init_distributed

    cpu_compat.enable("cpu")
    init_distributed("cpu")


def load_hf_into_model(family, model, src: str | Path, expect: ModelConfig | None = None, log=print) -> list[str]:
    """Load an HF directory of `family` into this rank's shard of `model` (converted in memory; each HF
    tensor is read only for the rows/columns this rank holds)."""
    head = heads.head_of_model(model)
    mapping = heads.mapping(family.checkpoint, head)
    m, raw = mapping.read_config(src)
    heads.check_head(raw, family.checkpoint, head, src)
    if expect is not None:
        _check_same_dims(m, expect, src)
    tensors, skipped = read_tensors(src, mapping.tensor_name)
    load_full(model, mapping.LazyCanonical(tensors, m, where=str(src)))
    return skipped + mapping.skipped_names(tensors, m)


def _check_same_dims(m: ModelConfig, expect: ModelConfig, src) -> None:
    # run-time choices, and the IndexShare parameters (the per-layer `indexer_types` they give are compared)
    ignore = {"dtype", "gdn_chunk_size", "gdn_cp", "attention_block", "index_block", "make_vocab_size_divisible_by",
              "index_topk_freq", "index_skip_topk_offset"}
    a, b = dataclasses.asdict(m), dataclasses.asdict(expect)
    diff = {k: (a[k], b[k]) for k in a if k not in ignore and a[k] != b[k]}
    if diff:
        raise CheckpointError(f"{src}: checkpoint config differs from the run config: "
                              + ", ".join(f"{k}={v[0]} (config says {v[1]})" for k, v in diff.items()))


def hf_tensors(family, model, m: ModelConfig, grads: bool = False, dst: int = 0):
    """(Hugging Face name, full tensor) for every tensor of the model (or its gradients), one mapping rule
    at a time, the tensor on rank `dst` (None elsewhere). Collective: every rank iterates to the end;
    rank `dst` holds one rule's tensors at most. The first item is (None, {name: (dtype, shape)}): what
    follows, for a writer that lays out a file before the data."""
    import torch.distributed as dist

    mapping = heads.mapping(family.checkpoint, heads.head_of_model(model))
    rules = mapping.rules(m)
    shapes = mapping.hf_shapes(m)
    local = dict(_local_dtypes(model, grads))  # (what a gradient is kept in differs from the parameter's)
    every = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if len(every) > 1:
        dist.all_gather_object(every, local)
    else:
        every = [local]
    dtypes = {k: v for d in every for k, v in d.items()}
    mine = not dist.is_initialized() or dist.get_rank() == dst
    yield None, {name: (dtypes[r.mcore[0]], shapes[name]) for r in rules for name in r.hf}
    stream = stream_full(model, grads=grads, dst=dst, order=[k for r in rules for k in r.mcore])
    for r in rules:
        got = {}
        for _ in r.mcore:
            key, t = next(stream)
            got[key] = t
        outs = mapping.mcore_to_hf({k: got[k] for k in r.mcore}, m, only=r) if mine else {}
        for name in r.hf:
            yield name, outs.get(name)


def dump_hf_tensors(family, model, m: ModelConfig, path: str | Path, grads: bool = False, log=print) -> int | None:
    """Write the model's full tensors (or gradients) under Hugging Face names to one safetensors file
    on rank 0 (`hf_tensors`: collective). Returns the bytes written on rank 0, None elsewhere."""
    import torch.distributed as dist

    from longstraw_mcore.checkpoint.safetensors_stream import SafetensorsWriter

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    stream = hf_tensors(family, model, m, grads)
    _, layout = next(stream)
    writer = SafetensorsWriter(path, [(name, dt, shape) for name, (dt, shape) in layout.items()]) if rank0 else None
    total = 0
    try:
        for name, t in stream:
            if rank0:
                writer.write(name, t)
                total += t.numel() * t.element_size()
        if rank0:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if rank0:
        log(f"[dump] wrote {len(layout)} {'gradients' if grads else 'tensors'} ({total / 2**20:.1f} MiB) to {path}")
    return total if rank0 else None


def _local_dtypes(model, grads: bool) -> dict[str, torch.dtype]:
    from longstraw_mcore.checkpoint.full_state import _entries, _leaves

    out = {}
    for e in _entries(model):
        t = e.data
        if grads:
            g = getattr(t, "main_grad", None) if getattr(t, "grad", None) is None else t.grad
            t = t if g is None else g
        for leaf in _leaves(e)[0]:
            out[leaf.key] = t.dtype
    return out
