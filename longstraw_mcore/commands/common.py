"""What the subcommands share: rank-0 printing, config loading, building and loading the model."""

from __future__ import annotations

import os


def is_rank0() -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def rank0_print(msg: str) -> None:
    if is_rank0():
        print(msg, flush=True)


class MetricsFile:
    """`--metrics-out`: one JSON line appended per record (rank 0 makes one; elsewhere None). Optional output:
    a record that cannot be written (disk full, a file system gone away) is counted, said once on stderr, and
    the run goes on; the next record written carries `metrics_write_failures`, the count so far."""

    def __init__(self, path: str):
        from pathlib import Path

        self.path, self.failures = Path(path), 0
        self.path.parent.mkdir(parents=True, exist_ok=True)  # (bad input: fails at start, before any work)

    def append(self, record: dict) -> None:
        import json
        import sys

        if self.failures:
            record = {**record, "metrics_write_failures": self.failures}
        size = None
        try:
            with open(self.path, "a") as f:
                size = f.tell()
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            if size is not None:  # (a record cut short by a full disk is taken back: every line stays JSON)
                try:
                    os.truncate(self.path, size)
                except OSError:
                    pass
            self.failures += 1
            if self.failures == 1:
                print(f"warning: {self.path}: a metrics record was not written ({e.strerror or e}); the run goes "
                      "on, counting such records (metrics_write_failures)", file=sys.stderr, flush=True)


def launch_world_size() -> int:
    """The world size of this launch, known before any process group: torchrun's (or an existing
    group's), or 1 for a plain one-process launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else 1


def load_run_config(args):
    """`--config` (or the config.json of `--hf`) plus trailing key=value overrides."""
    from longstraw_mcore.config import ConfigError, load_config

    base = None
    if args.config is None:
        if getattr(args, "hf", None) is None:
            raise ConfigError("give --config CFG (or --hf DIR, whose config.json defines the model)")
        import dataclasses

        from longstraw_mcore.families import read_hf_config

        m, _ = read_hf_config(args.hf)
        base = {"model": dataclasses.asdict(m)}
    return load_config(args.config, args.overrides, base=base)


def resolve_adapter(args, cfg):
    """The run's adapter before any model work: `--adapter DIR` (a PEFT directory, checked against the
    model: its r, alpha and targets become the run's `adapter` section) or a new one at adapter.rank > 0.
    Returns (cfg, whole adapter tensors or None)."""
    import dataclasses

    path = getattr(args, "adapter", None)
    if path is None:
        return cfg, None
    from longstraw_mcore.adapters.peft_io import read_peft
    from longstraw_mcore.families import get_family

    sites = get_family(cfg.model.family).checkpoint.adapter_sites(cfg.model)
    adapter, canonical = read_peft(path, sites, cfg.adapter)
    adapter.check_against(cfg.model.projection_shapes(), cfg.model.family)
    return dataclasses.replace(cfg, adapter=adapter), canonical


def build_and_load(cfg, par, hf, load, log_prefix, adapter=None):
    """This rank's model (its family's spec; at parallel.vpp > 1 its model chunks as one, ModelChunks), with weights
    from an HF directory or a Megatron checkpoint; with cfg.adapter.rank > 0 the base frozen and LoRA
    adapters on it (`adapter`: their whole tensors from resolve_adapter, or None for a new adapter)."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.memory import host_heap
    from longstraw_mcore.ops.dispatch import configure

    configure(cfg.ops)
    host_heap.apply(cfg.memory.host_heap)
    # the replay's log-prob chunks (and layer recompute) go through torch.utils.checkpoint, which imports
    # torch._dynamo at its first call (0.6 s of imports on the 2-core box, inside the first group's replay
    # otherwise): taken here, with the model, so a step's seconds are the step's
    import torch._dynamo  # noqa: F401

    family = get_family(cfg.model.family)
    model = family.build_rank(cfg.model, par, cfg.resolved_device())
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) > 1:  # parallel.vpp > 1: the rank's model chunks as one model (models/chunks.py)
        from longstraw_mcore.models.chunks import ModelChunks

        model = ModelChunks(chunks)
    if hf:
        from longstraw_mcore.checkpoint.convert import load_hf_into_model

        for c in chunks:
            skipped = load_hf_into_model(family, c, hf, expect=cfg.model)
        rank0_print(f"[{log_prefix}] loaded {hf} (converted in memory, this rank's shard only; skipped "
                    f"{len(skipped)} non-decoder tensors)")
    elif load:
        from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint

        for c in chunks:
            load_checkpoint(c, load)
        rank0_print(f"[{log_prefix}] loaded Megatron checkpoint {load}")
    if cfg.adapter.enabled:
        from longstraw_mcore.adapters.attach import attach

        base = sum(p.numel() for c in chunks for p in c.parameters())
        sets = [attach(c, family.checkpoint.adapter_sites(cfg.model), cfg.adapter, par, cfg.seed, adapter,
                       c.padded_vocab_size if c.post_process else None, vp_stage=v if len(chunks) > 1 else None)
                for v, c in enumerate(chunks)]
        a = cfg.adapter
        rank0_print(f"[{log_prefix}] LoRA r={a.rank} alpha={a.alpha:g} on {', '.join(a.resolved_targets(cfg.model.projection_shapes()))} "
                    f"({'read from the adapter directory' if adapter is not None else 'new: B = 0'}); "
                    f"rank 0 holds {sum(s.num_params() for s in sets):,} adapter parameters beside {base:,} "
                    f"frozen; adapter.prompt={a.prompt}")
    from longstraw_mcore.memory.layers import apply

    for c in chunks:
        apply(c, cfg.memory)  # recompute, state staging, the MLA query block (config/memory.py)
    return model


def reference_model(args, cfg, par):
    """The frozen reference policy of `--ref-hf / --ref-load`, or None."""
    if not (args.ref_hf or args.ref_load):
        return None
    import dataclasses

    from longstraw_mcore.config import AdapterConfig

    # the reference policy is the base model itself (no adapter)
    ref = build_and_load(dataclasses.replace(cfg, adapter=AdapterConfig()), par, args.ref_hf, args.ref_load, "ref")
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def trained_description(cfg) -> str:
    """What the gradient is of, in words (validate's receipt and train's log say it)."""
    a = cfg.adapter
    if not a.enabled:
        return f"every parameter; {cfg.replay.mode} mode"
    where = ("at every position (prompt and response)" if a.prompt == "adapted" else
             "at response positions only (adapter.prompt=frozen: the prompt state holds no trainable weight, "
             "so the gradient is exact in either mode)")
    return (f"LoRA r={a.rank} alpha={a.alpha:g} on {a.resolved_targets(cfg.model.projection_shapes())}, "
            f"base frozen ({a.base_dtype}), adapters acting {where}; {cfg.replay.mode} mode")
