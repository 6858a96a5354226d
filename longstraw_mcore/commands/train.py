"""`longstraw train`: GRPO / DPO with branch replay. Rollouts (JSON Lines), N prompt groups per step per
data-parallel rank, Megatron DDP + optimizer, one metrics line per step, atomic checkpoints every K
steps, --resume from the newest complete one. Every input is checked before any process group."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from longstraw_mcore.commands.common import (build_and_load, launch_world_size, load_run_config, rank0_print,
                                             reference_model, resolve_adapter, trained_description)
from longstraw_mcore.commands.preflight import check_fits, check_groups, check_run, check_sampling, check_save_dir
from longstraw_mcore.train.checkpoint_dirs import prune_steps, published_steps
from longstraw_mcore.train.run_dir import job_id, release, same_job, try_lock, write_identity
from longstraw_mcore.train.stop import STOPPED_EXIT, StopOnSignals


def _online_shape(cfg):
    """A stand-in group with the task's largest prompt and G full-length responses (for the checks)."""
    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.data.rollouts import RolloutGroup

    t, r = cfg.task, cfg.rollout
    t.check_vocab(cfg.model.vocab_size)
    if cfg.grpo.objective != "grpo":
        raise ConfigError(f"train --online samples GRPO groups; grpo.objective={cfg.grpo.objective!r}")
    if t.max_len > r.max_prompt_len:
        raise ConfigError(f"task.max_len={t.max_len} exceeds rollout.max_prompt_len={r.max_prompt_len}")
    return RolloutGroup(prompt=[0] * t.max_len, responses=[[0] * r.max_tokens] * r.group_size,
                        rewards=[0.0] * r.group_size)


def run(args) -> int:
    from longstraw_mcore.data.rollouts import load_rollouts

    cfg, adapter = resolve_adapter(args, load_run_config(args))
    check_run(cfg, "train", launch_world_size())
    online = getattr(args, "online", False)
    if cfg.replay.reuse_steps > 1 and not online:
        from longstraw_mcore.config import ConfigError

        raise ConfigError(f"replay.reuse_steps={cfg.replay.reuse_steps}: reusing a capture samples new branches "
                          "each step, which needs `train --online`")
    if online:
        check_sampling(cfg, "train --online")
        groups = [_online_shape(cfg)]
    else:
        groups = load_rollouts(args.rollouts, cfg.model.vocab_size)
        check_groups(cfg, groups, has_ref_model=bool(args.ref_hf or args.ref_load))
    check_fits(cfg, groups, launch_world_size(), args.force, "train")
    if args.save and not args.resume and published_steps(args.save) and same_job(args.save, cfg):
        rank0_print(f"[train] {args.save} holds this Slurm job's checkpoints (job {job_id()}, same config): a "
                    "requeue, resuming")
        args.resume = True
    start = check_save_dir(args.save, args.resume, args.steps)
    if start is not None and start >= args.steps:
        rank0_print(f"[train] {args.save} holds a complete checkpoint at step {start} >= --steps {args.steps}: "
                    "nothing to do")
        return 0

    from longstraw_mcore.parallel.groups import setup_parallel

    par = setup_parallel(cfg)
    if args.save:
        _lock(args.save, par)
        try:
            if par.rank == 0:
                write_identity(args.save, cfg, sys.argv)
            return _train(args, cfg, adapter, par, groups, online)
        finally:
            if par.rank == 0:
                release(args.save)
    return _train(args, cfg, adapter, par, groups, online)


def _lock(save: str, par) -> None:
    """One run per --save directory (train/run_dir.py): rank 0 takes the lock, every rank learns."""
    import torch.distributed as dist

    from longstraw_mcore.config import ConfigError

    box = [try_lock(save, rank0_print) if par.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])


def _train(args, cfg, adapter, par, groups, online) -> int:
    from longstraw_mcore.train.trainer import Trainer, build_training

    model = build_and_load(cfg, par, args.hf, args.load, "train", adapter)
    ddp, opt = build_training(model, cfg, par)
    source = None
    if online:
        from longstraw_mcore.rollout.online import OnlineGroups

        source = OnlineGroups(cfg)
        groups = []
    stop = StopOnSignals(cfg.train.stop_signals)  # (from here on a signal stops at a safe point, with a checkpoint)
    try:
        trainer = Trainer(cfg, par, ddp, opt, groups, ref_model=reference_model(args, cfg, par), log=rank0_print,
                          online=source, stop=stop)
        return _loop(args, cfg, par, ddp, trainer, groups, online, source, stop)
    finally:
        stop.close()


def _loop(args, cfg, par, ddp, trainer, groups, online, source, stop) -> int:
    if args.resume and trainer.resume(args.save):
        rank0_print(f"[train] resumed from {args.save} at step {trainer.step}")
    if trainer.step >= args.steps:
        rank0_print(f"[train] step {trainer.step} >= --steps {args.steps}: nothing to do")
        return 0
    what = f"{len(groups)} prompt groups"
    if online:
        t = cfg.task
        what = (f"online: key recall prompts of {t.min_len}-{t.max_len} tokens"
                + (f" (training from {t.start_len[0]}-{t.start_len[1]}: held {t.hold_steps} steps, "
                   f"grown over {t.ramp_steps})" if t.start_len else "")
                + f", G={cfg.rollout.group_size}, chance reward {source.task.chance:.3f}")
    rank0_print(f"[train] {what}, {cfg.train.groups_per_step} per step per data-parallel rank, "
                f"mode {cfg.replay.mode}, objective {cfg.grpo.objective}, layout tp={par.tp} pp={par.pp} cp={par.cp} "
                f"dp={par.dp}, "
                f"steps {trainer.step + 1}..{args.steps}; trains {trained_description(cfg)}")
    if args.metrics_out and par.rank == 0:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
    every = cfg.train.save_every
    evaluate = online and cfg.task.eval_prompts > 0 and cfg.task.eval_every > 0
    if evaluate and trainer.step == 0:
        _log(args, par, {"step": 0, "heldout_reward": source.held_out(ddp.module, par.pgs.dp, par.device)})
    limit = cfg.train.max_bad_steps
    while trainer.step < args.steps:
        m = trainer.run_step()
        if m.get("stopped"):
            return _stopped(args, trainer, stop, f"during step {m['abandoned_step']} (abandoned: it is redone on resume)")
        if evaluate and (trainer.step % cfg.task.eval_every == 0 or trainer.step == args.steps):
            m["heldout_reward"] = source.held_out(ddp.module, par.pgs.dp, par.device)
        _log(args, par, m)
        if limit and m["bad_steps_in_a_row"] >= limit:
            dst = _save(args, trainer)
            raise TrainingDiverged(f"step {trainer.step}: {limit} steps in a row had a non-finite loss or gradient "
                                   f"norm (train.max_bad_steps={limit}; last loss {m['loss']}, grad norm "
                                   f"{m['grad_norm']}); no update was made by them"
                                   + (f"; checkpoint {dst}" if dst else "") + ". Lower train.lr or check the data")
        if m.get("stop_requested"):
            return _stopped(args, trainer, stop, f"after step {trainer.step}")
        if args.save and ((every and trainer.step % every == 0) or trainer.step == args.steps):
            _save(args, trainer)
    return 0


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps non-finite steps in a row (cli.py prints it as one line, exit status 3)."""


def _save(args, trainer):
    if not args.save:
        return None
    dst = trainer.save(args.save)
    rank0_print(f"[train] checkpoint {dst}")
    keep = trainer.cfg.train.keep_last
    if keep and trainer.par.rank == 0:
        for old in prune_steps(args.save, keep):
            rank0_print(f"[train] removed {old} (train.keep_last={keep})")
    return dst


def _stopped(args, trainer, stop, when: str) -> int:
    """A stop request (train/stop.py): the last completed step saved (unless it is already), exit 75."""
    from longstraw_mcore.train.checkpoint_dirs import step_dir, verify

    have = args.save and step_dir(args.save, trainer.step).is_dir() and verify(step_dir(args.save, trainer.step)) is None
    dst = step_dir(args.save, trainer.step) if have else _save(args, trainer)
    why = stop.signal_name or "a peer rank's signal"
    rank0_print(f"[train] stopped by {why} {when}: " + (f"checkpoint of step {trainer.step} in {dst}; run the same "
                                                         "command with --resume to continue" if dst else
                                                         "no --save given, nothing kept")
                + f" (exit {STOPPED_EXIT})")
    return STOPPED_EXIT


def _log(args, par, m: dict) -> None:
    rank0_print("[train] " + json.dumps(m))
    if args.metrics_out and par.rank == 0:
        with open(args.metrics_out, "a") as f:
            f.write(json.dumps(m) + "\n")
