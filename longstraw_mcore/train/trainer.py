"""The Megatron training path for branch replay: DDP grad buffers, finalize_model_grads, Megatron's
optimizer, steps counted in prompt groups, checkpoints with exact resume.

A step on data-parallel rank d processes `groups_per_step` prompt groups (`group_index(step, d, i)`),
each scaled by 1/groups_per_step; DDP averages over data parallel, so the step objective is the mean
over all groups of the step. Branch gradients accumulate into DDP's buffers as each branch's
backward runs; `finalize_model_grads` reduces them once per step; then `optimizer.step()`.
Checkpoints (train/checkpoints.py): the model as a Megatron distributed checkpoint, the torch optimizer
states per rank (resume at the same layout, bit-exact), the step and the metrics so far, published
atomically; resume takes the newest complete one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

from longstraw_mcore.bench.memory import peak_bytes
from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta
from longstraw_mcore.config import ConfigError, RunConfig
from longstraw_mcore.data.rollouts import RolloutGroup
from longstraw_mcore.models.chunks import chunk_list
from longstraw_mcore.parallel.reduce import all_reduce_max, all_reduce_sum
from longstraw_mcore.replay.group_step import process_group
from longstraw_mcore.replay.watch import Stopped
from longstraw_mcore.train.checkpoint_dirs import CRITIC_DIR
from longstraw_mcore.train.checkpoints import load_step, resume_newest, save_step


def group_index(step: int, dp_rank: int, i: int, dp: int, groups_per_step: int, n_groups: int) -> int:
    """Which rollout group rank `dp_rank` trains on in (1-based) `step`, slot `i`: a fixed order, so a
    resumed run sees exactly the groups the uninterrupted run would have."""
    return ((step - 1) * dp * groups_per_step + dp_rank * groups_per_step + i) % n_groups


def build_training(model, cfg: RunConfig, par):
    """(gradient holder, optimizer) for `train.grad_reduction`: Megatron DDP + Megatron's optimizer
    (`step`), or per-micro-step reduce-scattered shards + AdamW on them (`micro_step`)."""
    if cfg.train.grad_reduction == "micro_step":
        from longstraw_mcore.train.zero2 import ShardedAdam, ShardedGradients

        t = cfg.train
        grads = ShardedGradients(model, par.pgs.dp_cp, par, t.grad_bucket_mib, offload=cfg.memory.grad_offload,
                                 expert_group=getattr(par.pgs, "expt_dp", None))
        return grads, ShardedAdam(grads, t.lr, (t.adam_beta1, t.adam_beta2), t.adam_eps, t.weight_decay, t.clip_grad,
                                  offload=cfg.memory.optimizer_offload)
    ddp = wrap_ddp(model, cfg, par)
    return ddp, build_optimizer(ddp, cfg, par)


def finalize_grads(holder, par) -> None:
    """Megatron DDP reduces its buffers now; sharded gradients were reduced after every micro-step
    (this rank joins the others' remaining reduction rounds)."""
    from megatron.core.distributed import finalize_model_grads

    if hasattr(holder, "finish"):
        holder.finish()
    else:
        finalize_model_grads(chunk_list(holder), pg_collection=par.pgs)


def gradients_finite(holder, par) -> bool:
    """Whether every rank's gradients are finite after the step's reduction (one max all-reduce over the
    world): the sharded holder's shards, or Megatron DDP's buffers (whole: with the distributed
    optimizer a rank's reduced part is its shard, the rest its own contributions, so a non-finite value
    from any rank shows on some rank)."""
    import torch

    if hasattr(holder, "shard"):
        flats = list(holder.shard)
    else:
        flats = [b.grad_data for b in holder.buffers + holder.expert_parallel_buffers]
    bad = any(not bool(torch.isfinite(f).all()) for f in flats)
    return all_reduce_max([float(bad)], None, par.device)[0] == 0.0


def wrap_ddp(model, cfg: RunConfig, par):
    """Megatron DDP around this rank's model, or around each of its model chunks (parallel.vpp > 1: a list or a
    ModelChunks, a DDPChunks back, models/chunks.py; the schedule's no_sync then covers every chunk)."""
    from longstraw_mcore.models.chunks import DDPChunks, ModelChunks

    if isinstance(model, (list, ModelChunks)):
        ddps = DDPChunks([wrap_ddp(c, cfg, par) for c in model],
                         model if isinstance(model, ModelChunks) else ModelChunks(list(model)))
        model[0].config.no_sync_func = [d.no_sync for d in ddps]  # (Megatron's interleaved schedule reads chunk 0's)
        return ddps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if cfg.uses_distributed_optimizer() and cfg.model.dtype == "float64":
        why = "train.distributed_optimizer=true" if cfg.train.distributed_optimizer else \
            "memory.optimizer_offload=true (Megatron's distributed optimizer under it)"
        raise ConfigError(f"{why} needs float32 or bfloat16 parameters "
                          "(Megatron's distributed optimizer has no float64 path); model.dtype=float64")
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=cfg.model.dtype == "bfloat16",
                                            overlap_grad_reduce=False,
                                            use_distributed_optimizer=cfg.uses_distributed_optimizer())
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model, pg_collection=par.pgs)
    model.config.no_sync_func = ddp.no_sync
    return ddp


def wrap_ddp_no_optimizer(model, cfg: RunConfig, par):
    """`wrap_ddp` for a step that builds no optimizer (`longstraw validate`, tools/bench_ladder.py): plain
    DDP gradient buffers, whatever the config says of the distributed optimizer and its offload."""
    import dataclasses

    return wrap_ddp(model, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, distributed_optimizer=False),
                                               memory=dataclasses.replace(cfg.memory, optimizer_offload=False)), par)


def offload_kwargs(cfg: RunConfig) -> dict:
    """memory.optimizer_offload through Megatron-Core's own CPU offload: the whole optimizer (fp32 master
    weights, Adam moments, the update) on the host (HybridDeviceOptimizer, offload fraction 1); pinned
    host copies on CUDA only (pinning needs a driver)."""
    if not cfg.memory.optimizer_offload:
        return {}
    device = cfg.resolved_device()
    # the config's own check, at the device `auto` resolved to (with CPU parameters Megatron-Core 0.19's
    # HybridDeviceOptimizer fails in _set_sub_optimizer_grads: KeyError)
    cfg.memory.check_run(cfg.replay.mode, cfg.model.dtype, cfg.train.grad_reduction, device)
    cuda = device == "cuda"
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": cuda,
            "pin_cpu_grads": cuda, "pin_cpu_params": cuda}


def build_optimizer(ddp, cfg: RunConfig, par):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = cfg.train
    ocfg = OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
                           adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                           clip_grad=t.clip_grad, bf16=cfg.model.dtype == "bfloat16",
                           params_dtype=cfg.model.torch_dtype,
                           use_distributed_optimizer=cfg.uses_distributed_optimizer(),
                           **offload_kwargs(cfg))
    # use_gloo_process_groups=False: the groups come from the explicit collection (gloo on CPU anyway)
    return get_megatron_optimizer(ocfg, chunk_list(ddp), use_gloo_process_groups=False, pg_collection=par.pgs)


class Trainer:
    def __init__(self, cfg: RunConfig, par, ddp, optimizer, groups: list[RolloutGroup], ref_model=None, log=print,
                 online=None, stop=None, critic=None, reward_model=None):
        """`groups`: the rollouts file's groups; or `online` (rollout/online.OnlineGroups): groups sampled
        from the current policy at every step. `stop`: train/stop.StopOnSignals (None: no stopping).
        `critic`: (its gradient holder, its optimizer) under grpo.objective=ppo, trained in the same step;
        `reward_model`: scores every response in place of the groups' rewards (commands/critic.py)."""
        from longstraw_mcore.replay.watch import Watch

        self.cfg, self.par, self.ddp, self.opt = cfg, par, ddp, optimizer
        self.groups, self.ref_model, self.log, self.online = groups, ref_model, log, online
        self.step = 0
        self.history: list[dict] = []
        self.stop = stop
        self.watch = Watch(log if par.rank == 0 else None, cfg.replay.progress_every_s, stop, par.lockstep,
                           par.device)
        self.bad_in_a_row = 0
        self.skipped_updates = 0
        self.critic, self.reward_model = critic, reward_model
        # tensors kept beside the decoder (a VLM's vision tower; checkpoint/passthrough.Source), copied into every
        # step saved: api.Session.build sets it from --hf / --load, a save or a resume moves it to that step
        self.passthrough = None

    def _dp_rank(self) -> int:
        return self.par.pgs.dp.rank()

    def run_step(self, groups: list[RolloutGroup] | None = None) -> dict:
        """One optimizer step over this rank's groups (`groups`: given by the caller, e.g. the Python API's
        own rollouts; else the online source's or the rollouts file's); returns the step's metrics (the
        same on every rank).

        Stopping (train/stop.py): a group's plan left at a safe point (`Stopped`) abandons the step: every
        rank still joins the step's reductions, then none updates, `self.step` stays the last completed
        one and the metrics say {"stopped": True}. A request seen only at the step's end lets it finish
        ({"stop_requested": True}). Non-finite loss or gradients: no update, `update_ok` False, counted
        (`skipped_updates`, `bad_steps_in_a_row`)."""
        cfg, par = self.cfg, self.par
        self.step += 1
        t0 = time.perf_counter()
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        if self.critic is not None:
            self.critic[0].zero_grad_buffer()
            self.critic[1].zero_grad()
        gps = cfg.train.groups_per_step
        # loss, reward, tokens, clipped, kl, skipped, groups, state bytes, prompt tokens, trained tokens (those
        # with a loss term: rollout loss_masks), replayed tokens (a prefix tree's shared segments once): host
        # numbers until reduced
        acc = [0.0] * 13  # (+ PPO's value loss and clipped values)
        t_sample = time.perf_counter()
        if groups is not None:
            mine = list(enumerate(groups))
        elif self.online is not None:  # sampled now from the weights being trained: on-policy
            mine = list(enumerate(self.online.groups(self.ddp.module, self.step, self._dp_rank(), par.dp, gps)))
        else:
            mine = [(gi, self.groups[gi]) for gi in
                    (group_index(self.step, self._dp_rank(), i, par.dp, gps, len(self.groups)) for i in range(gps))]
        t_sample = time.perf_counter() - t_sample
        if self.reward_model is not None:  # a learned reward (every rank scores its own groups)
            from dataclasses import replace

            from longstraw_mcore.replay.reward_model import reward_scores

            scores = reward_scores(self.reward_model, [g for _, g in mine], cfg.replay)
            mine = [(gi, replace(g, rewards=sc)) for (gi, g), sc in zip(mine, scores)]
        states = self.online.states if self.online is not None and groups is None else {}
        stopped = False
        try:
            for gi, group in mine:
                if self.critic is not None:
                    from longstraw_mcore.replay.ppo_step import process_ppo_group

                    st = process_ppo_group(self.ddp, self.critic[0], group, cfg.replay, cfg.grpo, cfg.ppo,
                                           scale=1.0 / gps, ref_model=self.ref_model, index=gi, watch=self.watch)
                else:
                    st = process_group(self.ddp, group, cfg.replay, cfg.grpo, scale=1.0 / gps,
                                       ref_model=self.ref_model, index=gi, state=states.get(gi), watch=self.watch)
                for j, x in enumerate((st.loss, st.reward_mean, st.tokens, st.clipped, st.kl_sum, float(st.skipped),
                                       1.0, st.state_bytes + st.ref_state_bytes, len(group.prompt), st.trained_tokens,
                                       st.replayed_tokens, getattr(st, "value_loss", 0.0),
                                       getattr(st, "value_clipped", 0))):
                    acc[j] += x
        except Stopped:
            stopped = True  # this rank's lockstep group left its plan; the others learn below
        finalize_grads(self.ddp, par)  # (every rank joins: the sharded reduction's rounds, DDP's reduce)
        if self.critic is not None:
            finalize_grads(self.critic[0], par)
        requested = self.stop is not None and self.stop.requested
        stop = all_reduce_max([float(stopped), float(requested)], None, par.device)  # the world agrees
        if stop[0] > 0:
            self.step -= 1  # abandoned: no update; the checkpoint and the resumed run start from the last step
            return {"stopped": True, "abandoned_step": self.step + 1}
        acc = all_reduce_sum(acc, par.pgs.dp, par.device)
        n = acc[6]
        bad = False
        if acc[5] == n:  # every group of the step had zero advantage: no gradient, no update
            ok, grad_norm = False, 0.0  # (Adam's momentum would still move the weights on zero grads)
        elif not (math.isfinite(acc[0]) and gradients_finite(self.ddp, par)):
            # skipped before the optimizer: Megatron's bf16 path checks for inf only with a loss scaler
            ok, grad_norm, bad = False, float("nan"), True
        else:
            ok, grad_norm, _ = self.opt.step()
            bad = not ok  # (the optimizer's own check: a non-finite norm)
        critic = self._critic_step(ok, acc) if self.critic is not None else {}
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.skipped_updates += int(bad)
        metrics = {
            "step": self.step, "loss": acc[0] / n, "reward_mean": acc[1] / n,
            "clip_frac": acc[3] / max(acc[9], 1.0), "kl": acc[4] / max(acc[9], 1.0),  # per trained token
            "grad_norm": float(grad_norm) if grad_norm is not None else None, "update_ok": bool(ok),
            "groups": int(n), "skipped_groups": int(acc[5]), "tokens": int(acc[2]), "trained_tokens": int(acc[9]),
            "response_tokens": int(acc[2]), "replayed_tokens": int(acc[10]),
            "replayed_fraction": acc[10] / acc[2] if acc[2] else 0.0,  # of the response tokens (skipped groups: 0)
            "seconds": time.perf_counter() - t0, "peak_bytes": peak_bytes(par.device),
            "state_bytes": int(acc[7] / n), "prompt_tokens": int(acc[8]),
            "skipped_updates": self.skipped_updates, "bad_steps_in_a_row": self.bad_in_a_row,
        }
        metrics.update(critic)
        if stop[1] > 0:
            metrics["stop_requested"] = True
        if self.online is not None and groups is None:
            metrics.update(self._task_metrics([len(r) for _, g in mine for r in g.responses]))
            metrics["sample_seconds"] = t_sample
            metrics["reused_states"] = self.online.reused  # groups replayed against an earlier step's capture
            # every token the step ran: the prompts (captured, and in exact mode recomputed) and the responses
            metrics["tokens_per_s"] = (acc[8] + acc[2]) / max(metrics["seconds"], 1e-9)
        self.history.append(metrics)
        return metrics

    def _critic_step(self, policy_ok: bool, acc: list) -> dict:
        """The critic's update (after the policy's; skipped with it, or when its own gradients are not
        finite) and its numbers."""
        holder, opt = self.critic
        ok, norm = False, float("nan")
        if policy_ok and math.isfinite(acc[11]) and gradients_finite(holder, self.par):
            ok, norm, _ = opt.step()
        n = acc[6]
        return {"value_loss": acc[11] / n, "value_clip_frac": acc[12] / max(acc[9], 1.0),
                "critic_grad_norm": float(norm) if norm is not None else None, "critic_update_ok": bool(ok)}

    def _task_metrics(self, lengths: list[int]) -> dict:
        """The user task's per-step numbers (rollout/dataset_groups.py): the mean of each reward function per
        response, failure and truncation counts, the mean response length; summed over data parallel."""
        if not hasattr(self.online, "take_stats"):
            return {}
        st = self.online.take_stats()
        keys = list(st)
        vals = all_reduce_sum([st[k] for k in keys] + [len(lengths), sum(lengths)], self.par.pgs.dp, self.par.device)
        n = max(vals[-2], 1.0)
        out = {k: (v / n if k.startswith("reward/") else int(v)) for k, v in zip(keys, vals)}
        out["response_len_mean"] = vals[-1] / n
        return out

    # --- checkpoints (train/checkpoints.py: atomic publication, verification, fallback) ------------

    def save(self, root: str | Path, fault=None) -> Path:
        """Step `self.step` under `root` (and the critic's under root/critic/, written first: a resume
        takes the newest step whose policy and critic are both complete)."""
        from longstraw_mcore.train.optimizer_state import supported

        if self.critic is not None:
            holder, opt = self.critic
            free = supported(opt, holder.module) is None
            save_step(Path(root) / CRITIC_DIR, self.step, holder.module, _torch_optimizers(opt),
                      holder.module.model_cfg, self.par.layout(), [], {"head": "token_value"}, fault=fault,
                      rank_extra=opt.extra_state() if hasattr(opt, "extra_state") and not free else None,
                      optimizer=opt if free else None)
        layout_free = supported(self.opt, self.ddp.module) is None
        extra = self.opt.extra_state() if hasattr(self.opt, "extra_state") and not layout_free else None
        kept = self.passthrough
        meta = {"run_config": asdict(self.cfg), **self._source_state()}
        if kept is not None:
            meta["hf_config"] = kept.config
        dst = save_step(root, self.step, self.ddp.module, _torch_optimizers(self.opt), self.cfg.model,
                        self.par.layout(), self.history, meta, fault=fault,
                        rank_extra=extra, optimizer=self.opt if layout_free else None,
                        files=None if kept is None else kept.write_into)
        if kept is not None:  # the newest step outlives train.keep_last's pruning: the next save links from it
            self.passthrough = kept.moved_to(dst)
        return dst

    def _load_critic(self, root: Path, step: int) -> None:
        """The critic's checkpoint of `step` (collective); CheckpointError when it is missing or damaged."""
        from longstraw_mcore.checkpoint.common import CheckpointError
        from longstraw_mcore.train.checkpoint_dirs import clean_unpublished, step_dir, verify

        holder, opt = self.critic
        path = step_dir(Path(root) / CRITIC_DIR, step)
        clean_unpublished(path.parent)
        why = verify(path) if path.is_dir() else "missing"
        if why is not None:
            raise CheckpointError(f"{path}: the critic's checkpoint of step {step}: {why}")
        load_step(path, holder.module, _torch_optimizers(opt), opt.reload_model_params,
                  getattr(opt, "load_extra_state", None), optimizer=opt)

    def _source_state(self) -> dict:
        """The online source's position in its dataset (rollout/dataset_groups.py), saved with the step."""
        get = getattr(self.online, "checkpoint_state", None)
        return {"dataset": get()} if get is not None else {}

    def resume(self, root: str | Path) -> bool:
        """Load the newest complete checkpoint under `root` (announcing any newer one skipped as
        damaged); False when there is none. At another layout than the checkpoint's when its optimizer
        state is layout-free (train/optimizer_state.py)."""
        from longstraw_mcore.train.optimizer_state import OPTIMIZER_DIR, supported

        metas, paths = [], []

        def load(path):
            _, meta = read_checkpoint_meta(path)
            metas.append(meta)
            paths.append(path)
            if meta.get("layout") != self.par.layout():
                why = supported(self.opt, self.ddp.module)
                if why is not None or not (path / OPTIMIZER_DIR).is_dir():
                    raise ConfigError(f"--resume: checkpoint {path} was written at layout {meta.get('layout')}, this "
                                      f"run is {self.par.layout()}; its optimizer state resumes only at the same "
                                      f"layout ({why or 'it was written per rank'})")
                self.log(f"[resume] {path.name} was written at layout {meta.get('layout')}: resharding its "
                         f"optimizer state to {self.par.layout()}")
            got = load_step(path, self.ddp.module, _torch_optimizers(self.opt), self.opt.reload_model_params,
                            getattr(self.opt, "load_extra_state", None), optimizer=self.opt)
            if self.critic is not None:
                self._load_critic(root, got[0])
            return got

        got = resume_newest(root, load, self.log)
        if got is None:
            return False
        self.step, self.history = got
        from longstraw_mcore.checkpoint.passthrough import Source

        self.passthrough = Source.of_checkpoint(paths[-1]) or self.passthrough  # the step's kept tensors, if any
        if hasattr(self.online, "restore"):
            self.online.restore(metas[-1].get("dataset"))
        return True


def _torch_optimizers(opt) -> list:
    """The torch optimizers inside Megatron's wrappers (Chained -> FP32/Distributed -> torch Adam).

    Their state dicts hold everything Adam needs, per-parameter `step` included; saving them per rank
    resumes bit-exactly at the same layout (Megatron 0.19's own DistributedOptimizer round trip loses
    `step` without Apex/TE, and Adam's bias correction then divides by zero)."""
    inner = getattr(opt, "chained_optimizers", [opt])
    return [o.optimizer for o in inner]



