"""One prompt group of PPO with a critic through branch replay (`grpo.objective=ppo`; loss/ppo.py).

    1. reference log-probs (grpo.beta > 0, when the rollout has none): the reference model, no autograd;
       old log-probs for the KL reward (beta > 0, when the rollout has none): the policy, no autograd
    2. the critic: its own prompt state captured once, each branch replayed for per-token values; in the
       loss function of each branch, GAE (from the rollout's old values, or these values without
       gradient) gives the branch's advantages and returns, and the clipped value loss is its term;
       exact mode sweeps the critic's prompt too
    3. the policy: captured and replayed the same way, the clipped surrogate with per-token advantages

Both models run in the same layout, one after the other (time-shared on the same ranks). Everything the
loss functions compute on the last pipeline stage reaches every stage in the branch results. The
per-branch values, advantages and returns come back in `PPOStats` (validate's receipt carries them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from longstraw_mcore.config import GRPOConfig, PPOConfig, ReplayConfig
from longstraw_mcore.data.rollouts import RolloutGroup
from longstraw_mcore.loss import ppo
from longstraw_mcore.loss.grpo import branch_loss, branch_weights
from longstraw_mcore.replay.engine import group_replay_steps, run_group, score_group, steps_tokens
from longstraw_mcore.replay.group_step import GroupStats, _scaled, with_reference


@dataclass
class PPOStats(GroupStats):
    value_loss: float = 0.0
    value_clipped: int = 0
    critic_state_bytes: int = 0
    values: list | None = None
    advantages: list | None = None
    returns: list | None = None


def _row(xs, b: int, like: torch.Tensor):
    return None if xs is None else torch.tensor(xs[b], dtype=like.dtype, device=like.device)


def process_ppo_group(policy, critic, group: RolloutGroup, rcfg: ReplayConfig, gcfg: GRPOConfig, pcfg: PPOConfig,
                      scale: float = 1.0, ref_model=None, index: int = 0, watch=None) -> PPOStats:
    """One group's policy and value losses, their gradients accumulated into each model (scaled by
    `scale`, the group's share of the step objective), and the group's statistics."""
    t0 = time.perf_counter()
    stats = PPOStats(reward_mean=sum(group.rewards) / len(group.rewards))
    group, stats.ref_state_bytes = with_reference(group, ref_model, rcfg, gcfg, index)
    old = group.old_logprobs
    if gcfg.beta > 0 and old is None:  # the KL reward needs the sampling policy's log-probs
        lps, st = score_group(policy, group.prompt, group.responses, rcfg)
        old = [lp.tolist() for lp in lps]
        del st
    masks = group.loss_masks or [None] * len(group.responses)
    weights = branch_weights(group.trained_tokens(), gcfg)

    def value_fn(b: int, values: torch.Tensor):
        cur = values.detach().tolist()
        base = group.old_values[b] if group.old_values is not None else cur
        r = ppo.token_rewards(group.rewards[b], len(cur), masks[b], gcfg.beta, None if old is None else old[b],
                              None if group.ref_logprobs is None else group.ref_logprobs[b])
        adv, ret = ppo.gae(r, base, masks[b], pcfg.gamma, pcfg.lam)
        mask = _row(group.loss_masks, b, values)
        f64 = dict(dtype=torch.float64)
        term, st = ppo.value_loss(values, torch.tensor(ret, **f64), torch.tensor(base, **f64), weights[b], pcfg, mask)
        return term, dict(st, values=cur, advantages=adv, returns=ret, tokens=len(cur),
                          trained=len(cur) if mask is None else int(mask.sum()))

    replay = group_replay_steps(policy, group.responses, rcfg)  # (both models: the same layout, the same steps)
    if watch is not None:
        watch.label = f"group {index} critic "
    vres, vstate, vsec = run_group(critic, group.prompt, group.responses, _scaled(value_fn, scale), rcfg,
                                   timed=True, replay=replay, watch=watch)
    critic_state_bytes = vstate.nbytes()
    del vstate  # time-shared: the critic's prompt state is gone before the policy captures its own
    per_v = [r.stats for r in vres]
    advs = [s["advantages"] for s in per_v]
    if pcfg.whiten_advantages:
        advs = ppo.whiten(advs, masks, gcfg.adv_eps)

    no_kl = replace(gcfg, beta=0.0)  # (under PPO the KL term is a reward, above)

    def policy_fn(b: int, logp: torch.Tensor):
        return branch_loss(logp, _row(advs, b, logp), weights[b], no_kl, old=_row(old, b, logp),
                           mask=_row(group.loss_masks, b, logp))

    if watch is not None:
        watch.label = f"group {index} "
    results, state, seconds = run_group(policy, group.prompt, group.responses, _scaled(policy_fn, scale), rcfg,
                                        timed=True, replay=replay, watch=watch)
    per = [r.stats for r in results]
    stats.loss = sum(s["loss"] for s in per)
    stats.value_loss = sum(s["loss"] for s in per_v)
    stats.tokens = sum(s["tokens"] for s in per)
    stats.trained_tokens = sum(s["trained"] for s in per)
    stats.replayed_tokens = steps_tokens(replay, group.responses)
    stats.clipped = sum(s["clipped"] for s in per)
    stats.value_clipped = sum(s["value_clipped"] for s in per_v)
    stats.state_bytes, stats.critic_state_bytes = state.nbytes(), critic_state_bytes
    stats.logprobs = [r.logprobs.tolist() for r in results]
    stats.values = [s["values"] for s in per_v]
    stats.advantages = advs
    stats.returns = [s["returns"] for s in per_v]
    seconds.update({f"critic_{k}": v for k, v in vsec.items() if k != "total"})
    seconds["total"] = time.perf_counter() - t0
    stats.seconds = seconds
    return stats

