"""The user's own task: a text dataset's prompts, sampled by the policy, scored by the user's reward
functions (and played in the user's environment), on every rank of a model replica alike.

    sample   one row's G responses against its captured prompt state (rollout/sampler.py), or G
             multi-turn episodes with an environment (rollout/episodes.py), the observations loss-masked
    score    every reward function on every group of a step, in worker processes (tasks/rewards.py),
             weighted (reward.weights) and added to the episodes' environment rewards

User code runs only on the replica's leader (parallel/groups.replica_group); what it returns (rewards,
observations, failure counts) is broadcast to the replica's other ranks, so the ranks of one replica
train on the same numbers even when a call fails or times out on the leader alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FAILURE_KINDS = ("exception", "timeout", "nonfinite", "wrong_count", "crash")
ENV_FAILURE_KINDS = FAILURE_KINDS + ("bad_return",)   # a step that does not return (str, bool, float)


@dataclass
class Sampled:
    """One row's group before scoring."""
    row: int
    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]
    loss_masks: list[list[int]] | None = None
    env_rewards: list[float] | None = None
    state: object = None


class TextTask:
    def __init__(self, cfg, tokenizer, pool, reward_names: list[str], has_env: bool, replica, leader: int, me: int,
                 log=print):
        """`pool` (tasks/rewards.UserPool): on the replica's leader only, None elsewhere."""
        self.cfg, self.tok, self.pool, self.names, self.has_env = cfg, tokenizer, pool, reward_names, has_env
        self.replica, self.leader, self.is_leader, self.log = replica, leader, me == leader, log
        w = cfg.reward.weights or [1.0] * len(reward_names)
        self.weights = [float(x) for x in w]
        self.keys = ([f"reward/{n}" for n in reward_names] + (["reward/env"] if has_env else [])
                     + [f"reward_failures/{k}" for k in FAILURE_KINDS]
                     + ([f"env_failures/{k}" for k in ENV_FAILURE_KINDS] + ["episodes_truncated"] if has_env else []))
        """The per-step sums `score` and `sample` add to (the same keys on every rank: reduced over data parallel)."""
        self.stats = dict.fromkeys(self.keys, 0.0)

    def share(self, obj):
        """`obj` as the replica's leader has it (a broadcast over the replica; itself when alone)."""
        if self.replica is None:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.replica)
        return box[0]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    # --- sampling ----------------------------------------------------------------------------------

    def sample(self, model, prompt: list[int], row: dict, row_index: int, rcfg, replay, index: int,
               state=None) -> Sampled:
        if not self.has_env:
            from longstraw_mcore.rollout.sampler import sample_group

            sg = sample_group(model, prompt, rcfg, replay, index=index, state=state)
            return Sampled(row_index, list(prompt), sg.responses, sg.logprobs, state=sg.state)
        return self._episodes(model, prompt, row, row_index, rcfg, replay, index, state)

    def _episodes(self, model, prompt, row, row_index, rcfg, replay, index, state) -> Sampled:
        from longstraw_mcore.rollout.episodes import sample_episodes

        G = rcfg.group_size
        handles = [self.pool.env_new(row, row_index) for _ in range(G)] if self.is_leader else None
        reward, fails = [0.0] * G, dict.fromkeys(ENV_FAILURE_KINDS, 0)

        def respond(turn, branches, turn_tokens):
            out = None
            if self.is_leader:
                out = {}
                for b in branches:
                    if not isinstance(handles[b], int):   # its reset failed (counted by the pool): over
                        fails[handles[b]] += turn == 0
                        reward[b] += self.pool.on_failure if turn == 0 else 0.0
                        out[b] = ([], True)
                going = [(b, t) for b, t in zip(branches, turn_tokens) if b not in out]
                replies = self.pool.env_steps([(handles[b], self.decode(t)) for b, t in going]) if going else []
                for (b, _), (obs, done, r, failure) in zip(going, replies):
                    reward[b] += r
                    if failure:
                        fails[failure] += 1
                    out[b] = (list(self.tok(obs, add_special_tokens=False)["input_ids"]) if obs else [], bool(done))
                out = [out[b] for b in branches]
            return self.share(out)

        ep = sample_episodes(model, prompt, rcfg, replay, index, respond, self.cfg.env.max_turns,
                             self.cfg.env.max_tokens, state)
        if self.is_leader:
            for h in handles:
                if isinstance(h, int):
                    self.pool.env_close(h)
        reward, fails = self.share((reward, fails))
        for kind, n in fails.items():
            self.stats[f"env_failures/{kind}"] += n
        self.stats["episodes_truncated"] += ep.truncated
        return Sampled(row_index, list(prompt), ep.responses, ep.logprobs, ep.loss_masks, reward, ep.state)

    # --- scoring -----------------------------------------------------------------------------------

    def score(self, items: list[tuple[Sampled, dict]]) -> list[list[float]]:
        """Each group's rewards: the weighted reward functions (+ its episodes' environment rewards);
        the per-function sums and failure counts go to `stats`. The same on every rank of the replica."""
        out = None
        if self.is_leader:
            from longstraw_mcore.tasks.rewards import RewardCall

            calls = [RewardCall(f, [self.decode(r) for r in s.responses], row, s.responses, s.row)
                     for s, row in items for f in range(len(self.names))]
            results = self.pool.score(calls) if calls else []
            totals, sums = [], dict.fromkeys(self.keys, 0.0)
            k = 0
            for s, _ in items:
                tot = list(s.env_rewards) if s.env_rewards is not None else [0.0] * len(s.responses)
                if s.env_rewards is not None:
                    sums["reward/env"] += sum(s.env_rewards)
                for f, name in enumerate(self.names):
                    res = results[k]
                    k += 1
                    sums[f"reward/{name}"] += sum(res.values)
                    if res.failure:
                        sums[f"reward_failures/{res.failure}"] += 1
                    tot = [a + self.weights[f] * v for a, v in zip(tot, res.values)]
                totals.append(tot)
            out = (totals, sums)
        totals, sums = self.share(out)
        for key, v in sums.items():
            self.stats[key] += v
        return totals

    def take_stats(self) -> dict:
        out, self.stats = self.stats, dict.fromkeys(self.keys, 0.0)
        return out

    def greedy(self, rcfg):
        return dataclasses.replace(rcfg, temperature=0.0, group_size=1)
