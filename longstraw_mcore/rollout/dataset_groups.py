"""On-policy prompt groups from the user's dataset (`train --online --dataset`), the counterpart of
rollout/online.OnlineGroups for the built-in tasks, with the same interface for the trainer.

Rows: a step's groups on data-parallel rank r are the rows at global positions base + r * n + i
(tasks/text_dataset.TextDataset.at: epochs of seeded permutations); `base` advances by dp * n at each
step (at each block's first step with replay.reuse_steps=K: the block's K steps reuse its prompts and
their captured states). The position is saved in the checkpoint and restored on resume, so the resumed
run draws the next rows, whatever its data-parallel size. Sampling index: position * K + the step
within the block, as the built-in tasks number their prompts (so equal prompts sample equal tokens).
Held-out rows (--eval-dataset) are decoded greedily, split over data-parallel ranks and scored.
"""

from __future__ import annotations

from longstraw_mcore.data.rollouts import RolloutGroup


def dataset_groups(cfg, par, user, log=print) -> "DatasetGroups":
    """The user's task (tasks/user_task.UserTask) on this rank: its reward / environment workers kept on
    the model replica's leader only (parallel/groups.replica_group: collective)."""
    from longstraw_mcore.parallel.groups import replica_group
    from longstraw_mcore.tasks.text_task import TextTask

    replica, leader = replica_group(par.pgs)
    if par.rank != leader:
        user.pool.close()
    task = TextTask(cfg, user.tokenizer, user.pool if par.rank == leader else None, user.reward_names, user.has_env,
                    replica, leader, par.rank, log)
    return DatasetGroups(cfg, task, user.train, user.heldout, log)


class DatasetGroups:
    def __init__(self, cfg, task, train, heldout=None, log=print):
        """`task`: tasks/text_task.TextTask; `train` / `heldout`: tasks/text_dataset.TextDataset."""
        self.cfg, self.task, self.data, self.heldout, self.log = cfg, task, train, heldout, log
        self.position = 0      # rows drawn so far over every data-parallel rank (the next block starts here)
        self.base = 0          # the current block's first position
        self.states: dict = {}
        self.reused = 0
        self.last: list[tuple[dict, list[str], list[float]]] = []   # (row, response texts, rewards) of the last step
        self.heldout_parts: dict = {}   # the last held_out's mean per reward function ("heldout_reward/<name>")

    # --- checkpoint --------------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        return {"position": self.position, "base": self.base, "rows": len(self.data), "sha256": self.data.sha256,
                "path": self.data.path}

    def restore(self, saved: dict | None) -> None:
        from longstraw_mcore.config import ConfigError

        if not saved:
            raise ConfigError("--resume: the checkpoint holds no dataset position (it was not written by a "
                              "`train --online --dataset` run)")
        if saved.get("sha256") != self.data.sha256:
            raise ConfigError(f"--resume: --dataset {self.data.path} is not the file the checkpoint was trained on "
                              f"({saved.get('path')}, {saved.get('rows')} rows, sha256 {str(saved.get('sha256'))[:12]}; "
                              f"this one {len(self.data)} rows, {self.data.sha256[:12]}): its position would "
                              "point at other rows")
        self.position, self.base = int(saved["position"]), int(saved["base"])

    # --- the trainer's interface -------------------------------------------------------------------

    def groups(self, model, step: int, dp_rank: int, dp: int, n: int) -> list[RolloutGroup]:
        from longstraw_mcore.replay.steps import prompt_is_frozen

        K = self.cfg.replay.reuse_steps
        within = (step - 1) % K
        keep = prompt_is_frozen(model)
        if within == 0:
            self.base, self.position = self.position, self.position + dp * n
        if within == 0 or not keep:
            self.states = {}
        sampled, reused = [], 0
        for i in range(n):
            pos = self.base + dp_rank * n + i
            r = self.data.at(pos)
            state = self.states.get(i)
            reused += state is not None
            s = self.task.sample(model, self.data.ids[r], self.data.rows[r], r, self.cfg.rollout, self.cfg.replay,
                                 pos * K + within, state)
            if keep:
                self.states[i] = s.state
            sampled.append(s)
        self.reused = reused
        rewards = self.task.score([(s, self.data.rows[s.row]) for s in sampled])
        self.last = [(self.data.rows[s.row], [self.task.decode(x) for x in s.responses[:2]], rw[:2])
                     for s, rw in zip(sampled[:1], rewards)]
        return [RolloutGroup(prompt=s.prompt, responses=s.responses, rewards=rw, old_logprobs=s.logprobs,
                             loss_masks=s.loss_masks) for s, rw in zip(sampled, rewards)]

    def take_stats(self) -> dict:
        return self.task.take_stats()

    def held_out(self, model, dp_group, device) -> float:
        """Mean reward of greedy responses on --eval-dataset's first task.eval_prompts rows (all when
        fewer): data-parallel rank r decodes rows r, r + dp, ...; the sum is reduced over `dp_group`."""
        from longstraw_mcore.parallel.reduce import all_reduce_sum

        if self.heldout is None:
            return float("nan")
        n = min(self.cfg.task.eval_prompts, len(self.heldout))
        greedy = self.task.greedy(self.cfg.rollout)
        mine = [self.task.sample(model, self.heldout.ids[j], self.heldout.rows[j], j, greedy, self.cfg.replay, -1 - j)
                for j in range(dp_group.rank(), n, dp_group.size())]
        rewards = self.task.score([(s, self.heldout.rows[s.row]) for s in mine])
        st = self.task.take_stats()   # (held-out calls are not the training step's)
        names = [k for k in st if k.startswith("reward/")]
        sums = all_reduce_sum([sum(r[0] for r in rewards)] + [st[k] for k in names], dp_group, device)
        self.heldout_parts = {"heldout_" + k: v / max(n, 1) for k, v in zip(names, sums[1:])}
        return sums[0] / max(n, 1)
