"""The GRPO objective per prompt group (ARCHITECTURE.md section 2), split into per-branch terms.

    A_b = (r_b - mean r) / (std r + eps)        (std: torch.std, unbiased; or mean-only)
    rho_t = exp(logp_t - old_t)                 (old = logp.detach() when the rollout has none: on-policy)
    l_t = -min(rho_t A_b, clip(rho_t, 1 - eps_low, 1 + eps_high) A_b) + beta * k3_t
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    L = sum_b w_b sum_t m_bt l_bt  token_mean: w_b = 1 / (sum_b' sum_t m_b't); seq_mean: w_b = 1 / (G' n_b)

m_bt is the rollout's loss mask (1 everywhere without one): a masked token gives no term and is not
counted; n_b = sum_t m_bt are branch b's trained tokens and G' the branches with n_b > 0 (a fully masked
branch has weight 0 and is left out of the sequence mean). Clipped tokens and the KL sum count trained
tokens only; every token's log-prob is still computed and reported.

L is a sum of branch terms, so each branch can be replayed and back-propagated on its own. A group
whose rewards are all equal has A = 0: with beta = 0 it contributes nothing and is skipped (counted,
never divided by zero); with beta > 0 its KL term still counts.
"""

from __future__ import annotations

import torch

from longstraw_mcore.config import GRPOConfig


def advantages(rewards: list[float], cfg: GRPOConfig) -> torch.Tensor | None:
    """Per-branch advantages in float64, or None when all rewards are equal (zero advantage)."""
    r = torch.tensor(rewards, dtype=torch.float64, device="cpu")  # host-side scalars
    if len(rewards) < 2 or bool((r == r[0]).all()):
        return None
    a = r - r.mean()
    return a / (r.std() + cfg.adv_eps) if cfg.std_normalize else a


def branch_weights(trained: list[int], cfg: GRPOConfig) -> list[float]:
    """w_b from each branch's trained token count n_b (its length without a loss mask)."""
    if cfg.aggregation == "token_mean":
        total = sum(trained)
        return [1.0 / total if n else 0.0 for n in trained]
    live = sum(1 for n in trained if n)
    return [1.0 / (live * n) if n else 0.0 for n in trained]


def branch_loss(logp: torch.Tensor, adv: float | torch.Tensor, weight: float, cfg: GRPOConfig,
                old: torch.Tensor | None = None, ref: torch.Tensor | None = None, mask: torch.Tensor | None = None):
    """One branch's term of L (a scalar with graph) and its stats (clipped and KL over the trained tokens;
    `tokens`: all replayed, `trained`: those with a loss term). `adv`: the branch's advantage, or one per
    token (PPO's, loss/ppo.py). `mask`: the 0/1 loss mask, or None."""
    old = logp.detach() if old is None else old.to(logp.dtype)
    keep = None if mask is None else mask.bool()
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl_sum = 0.0
    if cfg.beta > 0:
        if ref is None:
            raise ValueError("grpo.beta > 0 needs reference log-probs (ref_logprobs or a reference model)")
        d = ref.to(logp.dtype) - logp
        k3 = torch.exp(d) - d - 1
        per_token = per_token + cfg.beta * k3
        kl_sum = float((k3.detach() if keep is None else k3.detach()[keep]).sum())
    hit = (ratio * adv) > (clipped * adv)
    n_clipped = int((hit if keep is None else hit & keep).sum())  # (a zero advantage clips nothing)
    if keep is not None:  # (where, not a product: a masked token's term is dropped, whatever its value)
        per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    trained = int(logp.numel() if keep is None else keep.sum())
    return per_token.sum() * weight, {"clipped": n_clipped, "kl_sum": kl_sum, "tokens": int(logp.numel()),
                                      "trained": trained}


def group_loss_fn(group, cfg: GRPOConfig, adv: torch.Tensor | None):
    """`loss_fn(b, logp)` for the replay engine: branch b's term of the group objective."""
    weights = branch_weights(group.trained_tokens(), cfg)

    def loss_fn(b: int, logp: torch.Tensor):
        old = None if group.old_logprobs is None else torch.tensor(group.old_logprobs[b], dtype=logp.dtype,
                                                                    device=logp.device)
        ref = None if group.ref_logprobs is None else torch.tensor(group.ref_logprobs[b], dtype=logp.dtype,
                                                                    device=logp.device)
        mask = None if group.loss_masks is None else torch.tensor(group.loss_masks[b], dtype=logp.dtype,
                                                                  device=logp.device)
        a = 0.0 if adv is None else float(adv[b])
        return branch_loss(logp, a, weights[b], cfg, old=old, ref=ref, mask=mask)

    return loss_fn
