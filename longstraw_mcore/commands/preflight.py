"""Checks that run before any process group, allocation or write: a bad input fails in
milliseconds with one line naming the value and what would be valid (exit 2), not mid-run.

`check_run` (config x subcommand x world size), `check_groups` (rollouts x objective x reference),
`check_save_dir` (checkpoint directory x --resume x --steps). `longstraw check` runs them alone.
"""

from __future__ import annotations

from pathlib import Path

from longstraw_mcore.config import ConfigError, RunConfig

def check_run(cfg: RunConfig, cmd: str, world_size: int | None) -> int | None:
    """Layout and dtype for `cmd`; returns the data-parallel size when the world size is known."""
    m, p = cfg.model, cfg.parallel
    if m.dtype == "float16":
        raise ConfigError("model.dtype=float16: runs use bfloat16, float32 or float64 (float16 needs loss scaling, "
                          "which this project does not do); pass model.dtype=bfloat16 to cast float16 weights on load")
    if cmd == "train" and m.dtype == "float64" and cfg.train.grad_reduction == "step":
        raise ConfigError("model.dtype=float64: `longstraw train` with train.grad_reduction=step needs float32 or bfloat16 "
                          "(Megatron's optimizer and gradient clipping have no float64 path); use "
                          "train.grad_reduction=micro_step, or float64 in `longstraw validate`")
    p.stage_layers(m.num_layers)  # the pipeline split adds up (RunConfig checked it; a mutated config too)
    return None if world_size is None else p.dp_for(world_size)


def check_sampling(cfg: RunConfig, what: str) -> None:
    """Sampling (`rollout`, `train --online`) under expert parallelism: the data-parallel ranks sample
    different prompts, whose responses stop after different numbers of decode steps, while every MoE
    layer call is an all-to-all their EP group must make together; refused before anything starts
    rather than left to wait on a peer that has stopped decoding."""
    if cfg.parallel.ep > 1:
        raise ConfigError(f"{what} with parallel.ep={cfg.parallel.ep}: sampling is not built for expert parallelism "
                          "(the ranks of an EP group decode different prompts for different numbers of steps, and "
                          "their MoE all-to-alls need lockstep); sample with parallel.ep=1 (a rollouts file) and "
                          "train on it with expert parallelism")


def check_groups(cfg: RunConfig, groups, has_ref_model: bool) -> None:
    """The rollouts against the objective, and the reference model against what needs it."""
    from longstraw_mcore.data.rollouts import RolloutError
    from longstraw_mcore.loss.dpo import chosen_rejected

    g = cfg.grpo
    cp = cfg.parallel.cp
    if cp > 1:
        short = [i for i, grp in enumerate(groups) if len(grp.prompt) - 1 < cp]
        if short:
            i = short[0]
            raise RolloutError(f"group {i}: prompt of {len(groups[i].prompt)} tokens is too short for parallel.cp={cp} "
                               f"(every context-parallel rank needs at least one of the prompt[:-1] positions: "
                               f"need >= {cp + 1} tokens; {len(short)} group(s) affected)")
    if g.objective == "dpo":
        for i, grp in enumerate(groups):
            try:
                chosen_rejected(grp.rewards, f"group {i}")
            except ValueError as e:
                raise RolloutError(f"{e} (grpo.objective=dpo)") from None
        needs_ref = [i for i, grp in enumerate(groups) if grp.ref_logprobs is None]
        if has_ref_model and not needs_ref:
            raise ConfigError("a reference model (--ref-hf/--ref-load) was given but every group carries ref_logprobs, "
                              "so it would be unused; drop it or drop ref_logprobs from the rollouts")
        return
    missing = [i for i, grp in enumerate(groups) if grp.ref_logprobs is None]
    if g.beta > 0 and missing and not has_ref_model:
        raise ConfigError(f"grpo.beta={g.beta}: group {missing[0]} has no ref_logprobs ({len(missing)} of {len(groups)} "
                          "groups lack them) and no reference model was given; pass --ref-hf/--ref-load, add "
                          "ref_logprobs, or set grpo.beta=0")
    if has_ref_model and (g.beta == 0 or not missing):
        why = "grpo.beta=0 (no KL term)" if g.beta == 0 else "every group carries ref_logprobs"
        raise ConfigError(f"a reference model (--ref-hf/--ref-load) was given but {why}, so it would be unused; "
                          "drop it" + (" or set grpo.beta > 0" if g.beta == 0 else ""))


def check_save_dir(save: str | None, resume: bool, steps: int, critic: bool = False) -> int | None:
    """--save/--resume/--steps; returns the step a resume would start from (None: a fresh run). With a
    `critic` (PPO), a step counts only when the critic's checkpoint of it is complete too (DIR/critic)."""
    from longstraw_mcore.train.checkpoint_dirs import CRITIC_DIR, newest_complete, published_steps, step_dir, verify

    if steps < 1:
        raise ConfigError(f"--steps {steps}: must be >= 1")
    if resume and not save:
        raise ConfigError("--resume needs --save DIR (where the checkpoints are)")
    if not save:
        return None
    root = Path(save)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--save {save}: exists and is not a directory")
    published = published_steps(root)
    if not resume:
        if published:
            raise ConfigError(f"--save {save} already holds checkpoints (newest {published[-1][1].name}); pass --resume to "
                              "continue that run, or choose another directory")
        return None
    newest, _ = newest_complete(root)
    if newest is None:
        return 0
    step = int(newest.name.split("_")[1])
    if critic:
        done = [s for s, _ in published_steps(root) if s <= step and step_dir(root / CRITIC_DIR, s).is_dir()
                and verify(step_dir(root / CRITIC_DIR, s)) is None]
        return done[-1] if done else 0
    return step


def device_bytes(cfg, world_size: int) -> tuple[int, str]:
    """Memory one rank may use, and where the number comes from: LONGSTRAW_DEVICE_BYTES if set; CUDA: the
    device's total memory; CPU: physical memory / ranks on this node (LOCAL_WORLD_SIZE, or the world)."""
    import os

    if os.environ.get("LONGSTRAW_DEVICE_BYTES"):
        return int(os.environ["LONGSTRAW_DEVICE_BYTES"]), "LONGSTRAW_DEVICE_BYTES"
    if cfg.resolved_device() == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory), "the GPU"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size or 1))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(ranks, 1), f"RAM / {ranks} local rank(s)"


def check_fits(cfg, groups, world_size: int, force: bool, cmd: str) -> None:
    """Refuse, before any allocation, a run whose plan (planner/memory.py, for the largest group) does not
    fit a rank's memory; `--force` runs it anyway with a warning. `validate` builds no optimizer."""
    import sys

    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import plan_memory

    P = max(len(g.prompt) for g in groups)
    R = max(len(r) for g in groups for r in g.responses)
    G = max(len(g.responses) for g in groups)
    plan = plan_memory(get_family(cfg.model.family), cfg, P, R, G, world_size)
    if cmd == "validate":
        plan["optimizer"] = 0
    need = sum(plan.values())
    have, source = device_bytes(cfg, world_size)
    if need <= have:
        return
    gib = 2**30
    biggest = sorted(plan.items(), key=lambda kv: -kv[1])[:3]
    msg = (f"the plan for this run needs {need / gib:.2f} GiB per rank (P={P}, R={R}, G={G}; largest: "
           + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in biggest)
           + f") but a rank has {have / gib:.2f} GiB ({source}); see `longstraw plan`, change the layout or "
           "the mode, or pass --force to run anyway")
    if not force:
        raise ConfigError(msg)
    print(f"warning: {msg} (--force given: running anyway)", file=sys.stderr, flush=True)
