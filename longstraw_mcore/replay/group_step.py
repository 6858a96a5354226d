"""One prompt group through branch replay with the configured objective (GRPO or DPO).

`process_group` captures the prompt, replays the branches with their loss terms scaled by `scale`
(the group's share of the step objective), runs the exact-mode prompt backward, and returns the
group's metrics. Gradients accumulate into whatever the model accumulates into (param.grad, or the
DDP grad buffers). A GRPO group whose rewards are all equal and beta == 0 is skipped without any
model work (counted), except under expert parallelism, where its EP peers' MoE all-to-alls need this
rank: there it is replayed with zero advantages and no gradient; with beta > 0 its KL term still trains. Reference log-probs come from the
rollouts or, where a group has none, from `ref_model` scored by a no-grad replay (GRPO's KL term,
DPO's reference margin).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from longstraw_mcore.config import GRPOConfig, ReplayConfig
from longstraw_mcore.data.rollouts import RolloutGroup
from longstraw_mcore.loss import dpo
from longstraw_mcore.loss.grpo import advantages, group_loss_fn
from longstraw_mcore.replay.engine import group_replay_steps, run_group, score_group, steps_tokens
from longstraw_mcore.replay.steps import in_ep_lockstep


@dataclass
class GroupStats:
    loss: float = 0.0
    reward_mean: float = 0.0
    tokens: int = 0
    trained_tokens: int = 0
    """Response tokens with a loss term (tokens minus those rollout loss_masks zero)."""
    replayed_tokens: int = 0
    """Response tokens the replay ran: a prefix tree's shared segments once (replay/tree.py); 0 when skipped."""
    clipped: int = 0
    kl_sum: float = 0.0
    skipped: bool = False
    state_bytes: int = 0
    ref_state_bytes: int = 0
    logprobs: list | None = None
    seconds: dict | None = None


def _scaled(fn, scale: float):
    """The loss term times `scale`; its stats carry the unscaled value (they reach every pipeline
    stage with the branch results, while the loss itself is computed on the last stage only)."""
    def loss_fn(b, logp):
        loss, stats = fn(b, logp)
        return loss * scale, dict(stats, loss=float(loss.detach()))

    return loss_fn


def with_reference(group: RolloutGroup, ref_model, rcfg: ReplayConfig, gcfg: GRPOConfig, index: int):
    """(the group with reference log-probs where grpo.beta > 0 needs them, the reference state's bytes):
    the rollout's, or the reference model's scored without autograd."""
    if gcfg.beta == 0 or group.ref_logprobs is not None:
        return group, 0
    if ref_model is None:
        raise ValueError(f"group {index}: grpo.beta={gcfg.beta} needs ref_logprobs in the rollouts or a "
                         "reference model (--ref-hf / --ref-load)")
    ref_lps, ref_state = score_group(ref_model, group.prompt, group.responses, rcfg)
    return replace(group, ref_logprobs=[lp.tolist() for lp in ref_lps]), ref_state.nbytes()


def process_group(model, group: RolloutGroup, rcfg: ReplayConfig, gcfg: GRPOConfig, scale: float = 1.0,
                  ref_model=None, index: int = 0, state=None, watch=None) -> GroupStats:
    """One group's loss and gradient (`state`: its prompt's state captured before, reused with
    adapter.prompt=frozen: run_group; `watch`: progress and safe points, replay/watch.py)."""
    if gcfg.objective == "ppo":
        raise ValueError("grpo.objective=ppo runs through replay/ppo_step.process_ppo_group (it needs a critic)")
    t0 = time.perf_counter()
    stats = GroupStats(reward_mean=sum(group.rewards) / len(group.rewards))
    ref_state_bytes = 0
    if gcfg.objective == "dpo":
        chosen, rejected = dpo.chosen_rejected(group.rewards, f"group {index}")
        logps, _ = score_group(model, group.prompt, group.responses, rcfg)
        mk = group.loss_masks or [None] * len(group.responses)
        pi = {b: dpo.masked_sum(lp.tolist(), mk[b]) for b, lp in enumerate(logps)}
        if group.ref_logprobs is None and ref_model is not None:  # the reference policy, scored without autograd
            ref_lps, ref_state = score_group(ref_model, group.prompt, group.responses, rcfg)
            ref_state_bytes = ref_state.nbytes()
            del ref_state
            ref = {b: dpo.masked_sum(lp.tolist(), mk[b]) for b, lp in enumerate(ref_lps)}
        else:
            ref = {b: (dpo.masked_sum(group.ref_logprobs[b], mk[b]) if group.ref_logprobs is not None else 0.0)
                   for b in (0, 1)}
        loss, coeff = dpo.dpo_terms(pi, ref, chosen, rejected, gcfg.beta)
        fn = dpo.surrogate_loss_fn(coeff, group.loss_masks)
    else:
        adv = advantages(group.rewards, gcfg)
        if adv is None and gcfg.beta == 0:
            stats.skipped = True
            stats.tokens = sum(len(r) for r in group.responses)
            stats.trained_tokens = sum(group.trained_tokens())
            if not in_ep_lockstep(model):
                return stats
            # expert parallelism: the EP group's other ranks replay their groups now, and every MoE layer
            # exchanges tokens with this rank, so it replays this one too, with no gradient (advantages 0)
            adv, scale = [0.0] * len(group.responses), 0.0
        group, ref_state_bytes = with_reference(group, ref_model, rcfg, gcfg, index)
        fn = group_loss_fn(group, gcfg, adv)
        loss = None
    replay = group_replay_steps(model, group.responses, rcfg)  # (under EP: collectives decide tree and micro-steps)
    if watch is not None:
        watch.label = f"group {index} "
    results, state, seconds = run_group(model, group.prompt, group.responses, _scaled(fn, scale), rcfg, timed=True,
                                        state=state, replay=replay, watch=watch)
    per = [r.stats for r in results]
    if stats.skipped:  # (replayed under EP for its peers only)
        stats.seconds = seconds
        return stats
    stats.loss = loss if loss is not None else sum(s["loss"] for s in per)
    stats.tokens = sum(s["tokens"] for s in per)
    stats.trained_tokens = sum(s.get("trained", s["tokens"]) for s in per)
    stats.replayed_tokens = steps_tokens(replay, group.responses)
    stats.clipped = sum(s["clipped"] for s in per)
    stats.kl_sum = sum(s["kl_sum"] for s in per)
    stats.state_bytes, stats.ref_state_bytes = state.nbytes(), ref_state_bytes
    stats.logprobs = [r.logprobs.tolist() for r in results]
    seconds["total"] = time.perf_counter() - t0
    stats.seconds = seconds
    return stats
