"""`longstraw train`: GRPO / DPO with branch replay. Rollouts (JSON Lines), N prompt groups per step per
data-parallel rank, Megatron DDP + optimizer, one metrics line per step, atomic checkpoints every K
steps, --resume from the newest complete one. Every input is checked before any process group."""

from __future__ import annotations

import json
from pathlib import Path

from longstraw_mcore.commands.common import (build_and_load, launch_world_size, load_run_config, rank0_print,
                                             reference_model)
from longstraw_mcore.commands.preflight import check_fits, check_groups, check_run, check_save_dir


def run(args) -> int:
    from longstraw_mcore.data.rollouts import load_rollouts

    cfg = load_run_config(args)
    check_run(cfg, "train", launch_world_size())
    groups = load_rollouts(args.rollouts, cfg.model.vocab_size)
    check_groups(cfg, groups, has_ref_model=bool(args.ref_hf or args.ref_load))
    check_fits(cfg, groups, launch_world_size(), args.force, "train")
    start = check_save_dir(args.save, args.resume, args.steps)
    if start is not None and start >= args.steps:
        rank0_print(f"[train] {args.save} holds a complete checkpoint at step {start} >= --steps {args.steps}: "
                    "nothing to do")
        return 0

    from longstraw_mcore.parallel.groups import setup_parallel

    par = setup_parallel(cfg)
    from longstraw_mcore.train.trainer import Trainer, build_training

    model = build_and_load(cfg, par, args.hf, args.load, "train")
    ddp, opt = build_training(model, cfg, par)
    trainer = Trainer(cfg, par, ddp, opt, groups, ref_model=reference_model(args, cfg, par), log=rank0_print)
    if args.resume and trainer.resume(args.save):
        rank0_print(f"[train] resumed from {args.save} at step {trainer.step}")
    if trainer.step >= args.steps:
        rank0_print(f"[train] step {trainer.step} >= --steps {args.steps}: nothing to do")
        return 0
    rank0_print(f"[train] {len(groups)} prompt groups, {cfg.train.groups_per_step} per step per data-parallel rank, "
                f"mode {cfg.replay.mode}, objective {cfg.grpo.objective}, layout tp={par.tp} pp={par.pp} cp={par.cp} "
                f"dp={par.dp}, "
                f"steps {trainer.step + 1}..{args.steps}")
    if args.metrics_out and par.rank == 0:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
    every = cfg.train.save_every
    while trainer.step < args.steps:
        m = trainer.run_step()
        rank0_print("[train] " + json.dumps(m))
        if args.metrics_out and par.rank == 0:
            with open(args.metrics_out, "a") as f:
                f.write(json.dumps(m) + "\n")
        if args.save and ((every and trainer.step % every == 0) or trainer.step == args.steps):
            dst = trainer.save(args.save)
            rank0_print(f"[train] checkpoint {dst}")
    return 0
