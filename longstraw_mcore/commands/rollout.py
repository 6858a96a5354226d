"""`longstraw rollout`: sample G responses per prompt from the captured prompt state and write the
rollouts file `train` reads (prompt, responses, rewards, old_logprobs = the sampled tokens' log-probs).

  longstraw rollout --config CFG [--hf DIR | --load DIR] (--prompts FILE | --task-prompts N) --out FILE
      [rollout.temperature=.. rollout.top_p=.. rollout.max_tokens=.. rollout.stop_ids=[..]
       rollout.group_size=.. rollout.seed=..]

Prompts are split over the data-parallel ranks (prompt i on rank i % dp); every rank of one
data-parallel group samples the same tokens. Rank 0 writes the file atomically. Every input is
checked before any process group: a prompt longer than rollout.max_prompt_len, a bad temperature,
top-p or token count is refused naming it.
"""

from __future__ import annotations

import json
import os

from longstraw_mcore.commands.common import (build_and_load, launch_world_size, load_run_config, rank0_print,
                                             resolve_adapter)
from longstraw_mcore.commands.preflight import check_run, check_sampling
from longstraw_mcore.config import ConfigError


def _read_prompts(path: str, cfg) -> list[tuple[list[int], list[int] | None]]:
    from longstraw_mcore.rollout.sampler import check_prompt

    if not os.path.isfile(path):
        raise ConfigError(f"--prompts {path!r}: no such file")
    out = []
    with open(path) as f:
        for n, line in enumerate(x for x in f if x.strip()):
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--prompts {path}: line {n + 1} is not JSON ({e})") from None
            if not isinstance(d, dict) or not isinstance(d.get("prompt"), list):
                raise ConfigError(f"--prompts {path}: line {n + 1} needs {{\"prompt\": [token ids]}}")
            check_prompt(d["prompt"], cfg.rollout, cfg.model.vocab_size, f"--prompts {path} line {n + 1}")
            out.append((d["prompt"], d.get("key")))
    if not out:
        raise ConfigError(f"--prompts {path}: no prompts")
    return out


def run(args) -> int:
    cfg, adapter = resolve_adapter(args, load_run_config(args))
    check_run(cfg, "rollout", launch_world_size())
    check_sampling(cfg, "rollout")
    if (args.reward or args.env or args.tokenizer) and not args.dataset:
        raise ConfigError("--reward / --env / --tokenizer go with --dataset FILE")
    if args.dataset:
        from longstraw_mcore.tasks.user_task import prepare

        _check_out(args.out)
        user = prepare(args, cfg, rank0_print)
        try:
            return _run_dataset(args, user, adapter)
        finally:
            user.close()
    if args.task_prompts is not None:
        if args.task_prompts < 1:
            raise ConfigError(f"--task-prompts {args.task_prompts}: must be >= 1")
        from longstraw_mcore.rollout.online import OnlineGroups

        src = OnlineGroups(cfg)
        prompts = [src.example(i) for i in range(args.task_prompts)]
        task = src.task
    else:
        prompts, task = _read_prompts(args.prompts, cfg), None
    _check_out(args.out)

    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.rollout.sampler import sample_group
    from longstraw_mcore.tasks.key_recall import reward

    par = setup_parallel(cfg)
    model = build_and_load(cfg, par, args.hf, args.load, "rollout", adapter)
    model.eval()
    dp, me = par.dp, par.pgs.dp.rank()
    rank0_print(f"[rollout] {len(prompts)} prompts x G={cfg.rollout.group_size}, temperature {cfg.rollout.temperature}, "
                f"top-p {cfg.rollout.top_p}, up to {cfg.rollout.max_tokens} tokens, layout tp={par.tp} pp={par.pp} cp={par.cp} dp={dp}")
    mine = {}
    for i in range(me, len(prompts), dp):
        prompt, key = prompts[i]
        if task is not None:  # the task's own episode (tool lookup: two turns, the tool's token loss-masked)
            grp = task.rollout(model, prompt, key, cfg.rollout, cfg.replay, i)[0]
            rewards = grp.rewards
            mine[i] = {"prompt": prompt, "responses": grp.responses, "rewards": rewards,
                       "old_logprobs": grp.old_logprobs}
            if grp.loss_masks is not None:
                mine[i]["loss_masks"] = grp.loss_masks
        else:
            sg = sample_group(model, prompt, cfg.rollout, cfg.replay, index=i)
            rewards = [reward(r, key) if key else 0.0 for r in sg.responses]
            mine[i] = {"prompt": prompt, "responses": sg.responses, "rewards": rewards, "old_logprobs": sg.logprobs}
        if (i // dp) % max(1, len(prompts) // dp // 10) == 0:
            rank0_print(f"[rollout] prompt {i + 1}/{len(prompts)}: {len(prompt)} tokens, mean reward "
                        f"{sum(rewards) / len(rewards):.3f}")
    _write(args.out, mine, len(prompts), par)
    return 0


def _check_out(out: str) -> None:
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out!r}: folder {out_dir} does not exist")


def _write(out: str, mine: dict, n: int, par) -> None:
    """Every data-parallel rank's groups, in prompt order, written atomically by rank 0."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size(par.pgs.dp)
    dist.all_gather_object(every, mine, group=par.pgs.dp)
    if par.rank == 0:
        merged = {k: v for d in every for k, v in d.items()}
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            for i in range(n):
                f.write(json.dumps(merged[i]) + "\n")
        os.replace(tmp, out)
        mean = sum(sum(g["rewards"]) / len(g["rewards"]) for g in merged.values()) / len(merged)
        print(f"[rollout] wrote {n} groups to {out}; mean reward {mean:.4f}", flush=True)


def _run_dataset(args, user, adapter) -> int:
    """Every row of --dataset: G responses (or episodes) scored by the user's rewards; the file holds the
    texts and the row beside the ids."""
    from longstraw_mcore.rollout.dataset_groups import dataset_groups
    from longstraw_mcore.parallel.groups import setup_parallel

    cfg = user.cfg
    par = setup_parallel(cfg)
    model = build_and_load(cfg, par, args.hf, args.load, "rollout", adapter)
    model.eval()
    task = dataset_groups(cfg, par, user, rank0_print).task
    dp, me, data = par.dp, par.pgs.dp.rank(), user.train
    rank0_print(f"[rollout] {len(data)} rows of {data.path} x G={cfg.rollout.group_size}, temperature "
                f"{cfg.rollout.temperature}, up to {cfg.rollout.max_tokens} tokens per turn, rewards {task.names}")
    mine = {}
    for i in range(me, len(data), dp):
        s = task.sample(model, data.ids[i], data.rows[i], i, cfg.rollout, cfg.replay, i)
        rewards = task.score([(s, data.rows[i])])[0]
        mine[i] = {"prompt": s.prompt, "responses": s.responses, "rewards": rewards, "old_logprobs": s.logprobs,
                   **({"loss_masks": s.loss_masks} if s.loss_masks is not None else {}),
                   "texts": [task.decode(r) for r in s.responses], "row": data.rows[i]}
    _write(args.out, mine, len(data), par)
    return 0
