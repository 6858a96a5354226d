"""DPO on the replay machinery: two branches of one prompt, chosen (higher reward) and rejected.

    z = beta * ((pi_c - ref_c) - (pi_r - ref_r)),   L = -log sigmoid(z),   pi_x = sum_t m_x,t logp_x,t

m is the rollout's loss mask (1 everywhere without one): ref_x sums the same tokens.

L couples the two branches, so it is not a sum of per-branch terms. The branches are first scored
without autograd (cheap: no graph), which fixes dL/dpi_x; each branch is then replayed with autograd
and back-propagates the surrogate (dL/dpi_x) * pi_x, whose gradient is exactly dL/dtheta.
Reference log-probs are optional (absent: reference-free, ref = 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chosen_rejected(rewards: list[float], where: str = "group") -> tuple[int, int]:
    if len(rewards) != 2:
        raise ValueError(f"{where}: DPO needs exactly 2 responses (chosen, rejected), got {len(rewards)}")
    if rewards[0] == rewards[1]:
        raise ValueError(f"{where}: DPO needs different rewards to tell chosen from rejected, got {rewards}")
    return (0, 1) if rewards[0] > rewards[1] else (1, 0)


def dpo_terms(pi: dict[int, float], ref: dict[int, float], chosen: int, rejected: int, beta: float):
    """(loss, {branch: dL/dpi_branch}) from the scored sums."""
    z = torch.tensor(beta * ((pi[chosen] - ref[chosen]) - (pi[rejected] - ref[rejected])), dtype=torch.float64)
    loss = float(-F.logsigmoid(z))
    g = float(-beta * torch.sigmoid(-z))          # dL/dpi_chosen; dL/dpi_rejected = -g
    return loss, {chosen: g, rejected: -g}


def masked_sum(values, mask: list[int] | None) -> float:
    """sum_t m_t x_t over one response (every token without a mask)."""
    if mask is None:
        return float(sum(float(x) for x in values))
    return float(sum(float(x) for x, m in zip(values, mask) if m))


def surrogate_loss_fn(coeff: dict[int, float], masks: list[list[int]] | None = None):
    def loss_fn(b: int, logp: torch.Tensor):
        if masks is None:
            pi, trained = logp.sum(), int(logp.numel())
        else:
            keep = torch.tensor(masks[b], dtype=torch.bool, device=logp.device)
            pi, trained = torch.where(keep, logp, torch.zeros_like(logp)).sum(), int(keep.sum())
        return pi * coeff[b], {"tokens": int(logp.numel()), "trained": trained, "clipped": 0, "kl_sum": 0.0}

    return loss_fn
