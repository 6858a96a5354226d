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


def build_and_load(cfg, par, hf, load, log_prefix):
    """This rank's model (its family's spec), with weights from an HF directory or a Megatron checkpoint."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.ops.dispatch import configure

    configure(cfg.ops)
    family = get_family(cfg.model.family)
    model = family.build_model(cfg.model, par, cfg.resolved_device())
    if hf:
        from longstraw_mcore.checkpoint.convert import load_hf_into_model

        skipped = load_hf_into_model(family, model, hf, expect=cfg.model)
        rank0_print(f"[{log_prefix}] loaded {hf} (converted in memory, this rank's shard only; skipped "
                    f"{len(skipped)} non-decoder tensors)")
    elif load:
        from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint

        load_checkpoint(model, load)
        rank0_print(f"[{log_prefix}] loaded Megatron checkpoint {load}")
    return model


def reference_model(args, cfg, par):
    """The frozen reference policy of `--ref-hf / --ref-load`, or None."""
    if not (args.ref_hf or args.ref_load):
        return None
    ref = build_and_load(cfg, par, args.ref_hf, args.ref_load, "ref")
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
