"""`longstraw train`: GRPO / DPO with branch replay. Rollouts (JSON Lines), N prompt groups per step per
data-parallel rank, Megatron DDP + optimizer, one metrics line per step, atomic checkpoints every K
steps, --resume from the newest complete one. Every input is checked before any process group."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from longstraw_mcore.commands.common import (MetricsFile, build_and_load, launch_world_size, load_run_config,
                                             rank0_print, reference_model, resolve_adapter, trained_description)
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
    if cfg.grpo.objective == "dpo":
        raise ConfigError("train --online samples groups of G responses for grpo or ppo; grpo.objective='dpo' "
                          "needs rollouts with a chosen and a rejected response")
    if t.max_len > r.max_prompt_len:
        raise ConfigError(f"task.max_len={t.max_len} exceeds rollout.max_prompt_len={r.max_prompt_len}")
    return RolloutGroup(prompt=[0] * t.max_len, responses=[[0] * r.max_tokens] * r.group_size,
                        rewards=[0.0] * r.group_size)


def run(args) -> int:
    from longstraw_mcore.data.rollouts import load_rollouts

    cfg, adapter = resolve_adapter(args, load_run_config(args))
    check_run(cfg, "train", launch_world_size())
    online = getattr(args, "online", False)
    _check_task_args(args, online)
    if getattr(args, "tensorboard", None):
        _tensorboard_writer(None)  # (the package is there, before any model work)
    if cfg.replay.reuse_steps > 1 and not online:
        from longstraw_mcore.config import ConfigError

        raise ConfigError(f"replay.reuse_steps={cfg.replay.reuse_steps}: reusing a capture samples new branches "
                          "each step, which needs `train --online`")
    user = None
    if online:
        check_sampling(cfg, "train --online")
        if args.dataset:
            from longstraw_mcore.tasks.user_task import prepare

            user = prepare(args, cfg, rank0_print)
            cfg = user.cfg
            groups = [_dataset_shape(user)]
        else:
            groups = [_online_shape(cfg)]
    else:
        groups = load_rollouts(args.rollouts, cfg.model.vocab_size)
        check_groups(cfg, groups, has_ref_model=bool(args.ref_hf or args.ref_load))
    from longstraw_mcore.commands.critic import critic_config, reward_config

    critic_config(cfg, args.critic, args.critic_adapter)  # (refused here, before any model work)
    reward_config(cfg, args.reward_model, "train")
    try:
        return _checked(args, cfg, adapter, groups, online, user)
    finally:
        if user is not None:
            user.close()


def _checked(args, cfg, adapter, groups, online, user) -> int:
    check_fits(cfg, groups, launch_world_size(), args.force, "train")
    if args.save and not args.resume and published_steps(args.save) and same_job(args.save, cfg):
        rank0_print(f"[train] {args.save} holds this Slurm job's checkpoints (job {job_id()}, same config): a "
                    "requeue, resuming")
        args.resume = True
    start = check_save_dir(args.save, args.resume, args.steps, critic=args.critic is not None)
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
            return _train(args, cfg, adapter, par, groups, online, user)
        finally:
            if par.rank == 0:
                release(args.save)
    return _train(args, cfg, adapter, par, groups, online, user)


def _lock(save: str, par) -> None:
    """One run per --save directory (train/run_dir.py): rank 0 takes the lock, every rank learns."""
    import torch.distributed as dist

    from longstraw_mcore.config import ConfigError

    box = [try_lock(save, rank0_print) if par.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])


def _train(args, cfg, adapter, par, groups, online, user) -> int:
    from longstraw_mcore.api import Session
    from longstraw_mcore.rollout.dataset_groups import dataset_groups

    source = None
    if online:
        source = dataset_groups(cfg, par, user, rank0_print) if user is not None else _builtin_source(cfg)
        groups = []
    stop = StopOnSignals(cfg.train.stop_signals)  # (from here on a signal stops at a safe point, with a checkpoint)
    try:
        session = Session.build(args, cfg, adapter, par, groups, online=source, stop=stop, log=rank0_print)
        return _loop(args, cfg, par, session.ddp, session.trainer, groups, online, source, stop)
    finally:
        stop.close()


def _builtin_source(cfg):
    from longstraw_mcore.rollout.online import OnlineGroups

    return OnlineGroups(cfg)


def _check_task_args(args, online: bool) -> None:
    from longstraw_mcore.config import ConfigError

    given = [f for f in ("dataset", "eval_dataset", "tokenizer", "reward", "env") if getattr(args, f, None)]
    if given and not online:
        raise ConfigError(f"--{given[0].replace('_', '-')} goes with --online (your own task, sampled on-policy)")
    if given and "dataset" not in given:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --dataset FILE (the prompts)")


def _dataset_shape(user):
    """A stand-in group for the checks: the dataset's longest prompt, G responses of the longest kind."""
    from longstraw_mcore.data.rollouts import RolloutGroup

    r = user.cfg.rollout
    longest = max(len(x) for x in user.train.ids + (user.heldout.ids if user.heldout else []))
    return RolloutGroup(prompt=[0] * longest, responses=[[0] * user.longest_response()] * r.group_size,
                        rewards=[0.0] * r.group_size)


def _loop(args, cfg, par, ddp, trainer, groups, online, source, stop) -> int:
    if args.resume and trainer.resume(args.save):
        rank0_print(f"[train] resumed from {args.save} at step {trainer.step}")
    if trainer.step >= args.steps:
        rank0_print(f"[train] step {trainer.step} >= --steps {args.steps}: nothing to do")
        return 0
    what = f"{len(groups)} prompt groups"
    if hasattr(source, "data"):
        d, task = source.data, source.task
        sizes = [len(x) for x in d.ids]
        what = (f"online: {len(d)} rows of {d.path} ({min(sizes)}-{max(sizes)} tokens"
                + (f", {d.truncated} cut" if d.truncated else "") + f"), rewards {task.names} weights {task.weights}"
                + (f", environment up to {cfg.env.max_turns} turns" if task.has_env else "")
                + f", G={cfg.rollout.group_size}, stop ids {cfg.rollout.stop_ids}")
    elif online:
        t = cfg.task
        what = (f"online: key recall prompts of {t.min_len}-{t.max_len} tokens"
                + (f" (training from {t.start_len[0]}-{t.start_len[1]}: held {t.hold_steps} steps, "
                   f"grown over {t.ramp_steps})" if t.start_len else "")
                + f", G={cfg.rollout.group_size}, chance reward {source.task.chance:.3f}")
    rank0_print(f"[train] {what}, {cfg.train.groups_per_step} per step per data-parallel rank, "
                f"mode {cfg.replay.mode}, objective {cfg.grpo.objective}, layout tp={par.tp} pp={par.pp} cp={par.cp} "
                f"dp={par.dp}, "
                f"steps {trainer.step + 1}..{args.steps}; trains {trained_description(cfg)}")
    every = cfg.train.save_every
    evaluate = online and cfg.task.eval_prompts > 0 and cfg.task.eval_every > 0 and \
        getattr(source, "heldout", True) is not None
    log = _Log(args, par, trainer.step)
    if evaluate and trainer.step == 0:
        log({"step": 0, "heldout_reward": source.held_out(ddp.module, par.pgs.dp, par.device),
             **getattr(source, "heldout_parts", {})})
    limit = cfg.train.max_bad_steps
    while trainer.step < args.steps:
        m = trainer.run_step()
        if m.get("stopped"):
            return _stopped(args, trainer, stop, f"during step {m['abandoned_step']} (abandoned: it is redone on resume)")
        if evaluate and (trainer.step % cfg.task.eval_every == 0 or trainer.step == args.steps):
            m["heldout_reward"] = source.held_out(ddp.module, par.pgs.dp, par.device)
            m.update(getattr(source, "heldout_parts", {}))
        log(m)
        if cfg.task.log_samples and trainer.step % cfg.task.log_samples == 0 and getattr(source, "last", None):
            _print_samples(source.last)
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
        if trainer.critic is not None:
            from longstraw_mcore.train.checkpoint_dirs import CRITIC_DIR

            prune_steps(Path(args.save) / CRITIC_DIR, keep)
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


class _Log:
    """A step's record: the whole of it to --metrics-out (and --tensorboard), one short line to the console
    (step, rewards, loss, KL, tokens/s, ETA). Rank 0."""

    def __init__(self, args, par, first_step: int):
        import time

        self.args, self.on, self.steps = args, par.rank == 0, args.steps
        self.t0, self.first = time.perf_counter(), first_step
        self.metrics = MetricsFile(args.metrics_out) if self.on and args.metrics_out else None
        self.tb = _tensorboard_writer(args.tensorboard) if self.on and getattr(args, "tensorboard", None) else None

    def __call__(self, m: dict) -> None:
        import time

        if not self.on:
            return
        if self.metrics is not None:
            self.metrics.append(m)
        if self.tb is not None:
            try:
                for k, v in m.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                        self.tb.add_scalar(k, v, m["step"])
                self.tb.flush()
            except Exception as e:  # noqa: BLE001 - optional output: the run goes on without it
                print(f"warning: --tensorboard {self.args.tensorboard}: {type(e).__name__}: {e}; TensorBoard "
                      "output stops here, the run goes on (metrics.jsonl has every step)", file=sys.stderr, flush=True)
                self.tb = None
        done = m["step"] - self.first
        eta = (time.perf_counter() - self.t0) / done * (self.steps - m["step"]) if done > 0 and "loss" in m else None
        print("[train] " + _line(m, self.steps, eta), flush=True)


def _line(m: dict, steps: int, eta: float | None) -> str:
    parts = [f"step {m['step']}/{steps}"]
    for key, name, fmt in (("reward_mean", "reward", ".3f"), ("heldout_reward", "held-out", ".3f"),
                           ("loss", "loss", ".4g"), ("value_loss", "value loss", ".4g"), ("kl", "kl", ".3g"),
                           ("tokens_per_s", "tok/s", ",.0f")):
        if isinstance(m.get(key), (int, float)):
            parts.append(f"{name} {m[key]:{fmt}}")
    fails = sum(v for k, v in m.items() if k.startswith(("reward_failures/", "env_failures/")))
    if fails:
        parts.append(f"failures {fails}")
    if m.get("update_ok") is False:
        parts.append("no update")
    if eta is not None:
        parts.append(f"eta {int(eta) // 60}m{int(eta) % 60:02d}s")
    return ", ".join(parts)


def _print_samples(last) -> None:
    for row, texts, rewards in last:
        head = (row.get("prompt") if isinstance(row.get("prompt"), str) else json.dumps(row.get("messages")))[-80:]
        rank0_print(f"[sample] ...{head!r}")
        for t, r in zip(texts, rewards):
            rank0_print(f"[sample]   reward {r:.3f}: {t[:160]!r}")


def _tensorboard_writer(path):
    """torch's SummaryWriter on `path` (None: only checks that the package is installed)."""
    from longstraw_mcore.config import ConfigError

    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as e:  # noqa: BLE001 (ImportError, or the package half-installed)
        raise ConfigError(f"--tensorboard needs the `tensorboard` package ({type(e).__name__}: {e}); install the "
                          "project's extra: pip install -e '.[tensorboard]'") from None
    return SummaryWriter(path) if path else None
