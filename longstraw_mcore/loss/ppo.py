"""PPO with a critic, per branch (`grpo.objective=ppo`; the `ppo` config section; the policy clip is GRPO's).

Per branch b with response tokens t = 0..R-1, loss mask m_t (1 everywhere without one), the critic's
value V_t of token t read at the position whose logits give t's log-prob (the position before t):

    rewards     r_t = -beta (old_t - ref_t) on trained tokens (grpo.beta > 0; old: the rollout's log-probs,
                or the current ones), plus the branch's outcome reward on its last trained token
    GAE         over the trained tokens in order, as if the masked ones were not there (a tool's output is
                context, not a step of the policy): with u_1 < ... < u_n the trained positions,
                delta_k = r_{u_k} + gamma V_{u_{k+1}} - V_{u_k}  (V = 0 after the last),
                A_{u_k} = delta_k + gamma lam A_{u_{k+1}};  masked tokens carry no advantage (0)
    values      V = the rollout's `old_values` when it has them, else the critic's current values (no gradient)
    returns     R_t = A_t + V_t (no gradient)
    whitening   ppo.whiten_advantages: A <- (A - mean) / (std + grpo.adv_eps) over the group's trained tokens
    policy      l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t), rho_t = exp(logp_t - old_t):
                GRPO's branch term with per-token advantages and no KL term (loss/grpo.py branch_loss)
    value       v_t = 0.5 max((V'_t - R_t)^2, (V_t + clip(V'_t - V_t, -c, c) - R_t)^2) (V': the critic's
                values with gradient; c = ppo.value_clip; c = 0: the first term alone)
    L_pi = sum_b w_b sum_t m_t l_t,  L_V = ppo.vf_coef sum_b w_b sum_t m_t v_t   (w_b: grpo.aggregation, as GRPO)

The policy and the critic are separate models: L_pi trains the policy, L_V the critic.
"""

from __future__ import annotations

import torch

from longstraw_mcore.config import PPOConfig


def token_rewards(outcome: float, n: int, mask: list[int] | None, beta: float = 0.0, old: list[float] | None = None,
                  ref: list[float] | None = None) -> list[float]:
    """r_t of one branch of n tokens (float64 host scalars)."""
    keep = [1] * n if mask is None else list(mask)
    r = [0.0] * n
    if beta > 0:
        if old is None or ref is None:
            raise ValueError("grpo.beta > 0 under PPO needs old and reference log-probs")
        r = [-beta * (o - f) if k else 0.0 for o, f, k in zip(old, ref, keep)]
    last = max((t for t in range(n) if keep[t]), default=None)
    if last is not None:
        r[last] += outcome
    return r


def gae(rewards: list[float], values: list[float], mask: list[int] | None, gamma: float, lam: float):
    """(advantages, returns) of one branch, float64 lists; masked tokens get 0 and are skipped."""
    n = len(rewards)
    keep = [1] * n if mask is None else list(mask)
    adv = [0.0] * n
    ret = [0.0] * n
    next_v, last = 0.0, 0.0
    for t in range(n - 1, -1, -1):
        if not keep[t]:
            continue
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t], ret[t] = last, last + values[t]
        next_v = values[t]
    return adv, ret


def whiten(advs: list[list[float]], masks: list[list[int] | None], eps: float) -> list[list[float]]:
    """Advantages over the group's trained tokens to mean 0, std 1 (torch.std, unbiased)."""
    flat = [a for adv, m in zip(advs, masks) for t, a in enumerate(adv) if m is None or m[t]]
    if len(flat) < 2:
        return advs
    x = torch.tensor(flat, dtype=torch.float64)
    mean, std = float(x.mean()), float(x.std())
    return [[(a - mean) / (std + eps) if (m is None or m[t]) else 0.0 for t, a in enumerate(adv)]
            for adv, m in zip(advs, masks)]


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, weight: float, cfg: PPOConfig,
               mask: torch.Tensor | None):
    """One branch's value term (vf_coef included; scalar with graph) and its stats."""
    returns, old_values = returns.to(values.dtype), old_values.to(values.dtype)
    err = (values - returns) ** 2
    if cfg.value_clip > 0:
        v_clip = old_values + torch.clamp(values - old_values, -cfg.value_clip, cfg.value_clip)
        err_clip = (v_clip - returns) ** 2
        hit = err_clip > err
        err = torch.maximum(err, err_clip)
    else:
        hit = torch.zeros_like(err, dtype=torch.bool)
    keep = torch.ones_like(values, dtype=torch.bool) if mask is None else mask.bool()
    per_token = torch.where(keep, 0.5 * err, torch.zeros_like(err))
    term = per_token.sum() * (weight * cfg.vf_coef)
    return term, {"value_clipped": int((hit & keep).sum()), "value_loss": float(term.detach())}
