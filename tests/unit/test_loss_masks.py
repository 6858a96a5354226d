"""Rollout loss masks (data/rollouts.py `loss_masks`, loss/grpo.py, loss/dpo.py).

- Bad input is refused naming the group, the response and the value: a mask of the wrong length, a
  value other than 0/1, a group in which every token of every response is masked.
- GRPO with masks equals the objective written out token by token here (float64), its value and its
  gradient with respect to every log-prob, for token_mean and seq_mean, with clipping and the k3 KL
  term: a masked token gives no term and is not counted; a fully masked branch has weight 0 and is
  left out of the sequence mean; clipped tokens and the KL sum count trained tokens only. Whatever a
  masked token's old or reference log-prob, nothing changes.
- DPO sums the trained tokens' log-probs (policy and reference alike).
- The file round-trips through write_rollouts / load_rollouts.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from longstraw_mcore.config import GRPOConfig
from longstraw_mcore.data.rollouts import RolloutError, RolloutGroup, load_rollouts, parse_group, write_rollouts
from longstraw_mcore.loss import dpo
from longstraw_mcore.loss.grpo import advantages, group_loss_fn


def _obj(**extra):
    return dict(prompt=[1, 2], responses=[[3, 4, 5], [6, 7]], rewards=[1.0, 0.0], **extra)


@pytest.mark.parametrize("masks, message", [
    ([[1, 0, 1]], "group 4: loss_masks: expected one 0/1 list per response (2), got 1"),
    ([[1, 0], [1, 1]], "group 4: loss_masks[0]: length 2 != response length 3"),
    ([[1, 2, 1], [1, 1]], "group 4: loss_masks[0][1]=2: a loss mask holds 0 (no loss term) or 1 (trained)"),
    ([[1, 1, 1], [1, 0.5]], "group 4: loss_masks[1][1]=0.5: a loss mask holds 0"),
    ([[1, 1, 1], [True, 1]], "group 4: loss_masks[1][0]=True: a loss mask holds 0"),
    ([[0, 0, 0], [0, 0]], "group 4: every token of every response is masked (responses [0, 1] all zero"),
])
def test_bad_masks_are_refused_naming_group_response_and_value(masks, message):
    with pytest.raises(RolloutError) as e:
        parse_group(_obj(loss_masks=masks), 4, vocab_size=16)
    assert message in str(e.value), str(e.value)


def test_masks_round_trip_and_one_fully_masked_response_is_allowed(tmp_path):
    g = parse_group(_obj(loss_masks=[[1, 0, 1], [0, 0]]), 0, vocab_size=16)
    assert g.trained_tokens() == [2, 0]
    path = tmp_path / "r.jsonl"
    write_rollouts(path, [g, parse_group(_obj(), 1, 16)])
    back = load_rollouts(path, 16)
    assert back[0].loss_masks == [[1, 0, 1], [0, 0]] and back[1].loss_masks is None
    assert json.loads(path.read_text().splitlines()[0])["loss_masks"] == [[1, 0, 1], [0, 0]]
    assert back[1].trained_tokens() == [3, 2]


def _written_out(logps, group, cfg):
    """The masked GRPO objective token by token (plain Python over float64 tensors)."""
    r = group.rewards
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    adv = [(x - mean) / (std + cfg.adv_eps) for x in r]
    n = [sum(mk) for mk in group.loss_masks]
    live = sum(1 for k in n if k)
    total = logps[0].new_zeros(())
    for b, lp in enumerate(logps):
        if not n[b]:
            continue
        w = 1.0 / sum(n) if cfg.aggregation == "token_mean" else 1.0 / (live * n[b])
        for t in range(lp.numel()):
            if not group.loss_masks[b][t]:
                continue
            rho = torch.exp(lp[t] - group.old_logprobs[b][t])
            term = -torch.minimum(rho * adv[b], rho.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv[b])
            d = group.ref_logprobs[b][t] - lp[t]
            total = total + w * (term + cfg.beta * (torch.exp(d) - d - 1))
    return total


def _group(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 6, 4]
    resp = [torch.randint(0, 16, (k,), generator=g).tolist() for k in lengths]
    masks = [[1, 0, 0, 1, 1], [0, 0, 0], [1, 1, 0, 1, 0, 1], [1, 1, 1, 1]]  # branch 1 fully masked
    old = [(-2.0 + 0.5 * torch.randn(k, generator=g, dtype=torch.float64)).tolist() for k in lengths]
    ref = [(-2.0 + 0.5 * torch.randn(k, generator=g, dtype=torch.float64)).tolist() for k in lengths]
    return RolloutGroup(prompt=[1, 2, 3], responses=resp, rewards=[0.3, 1.0, -0.5, 0.8], old_logprobs=old,
                        ref_logprobs=ref, loss_masks=masks), g


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_grpo_with_masks_equals_the_written_out_objective_and_its_gradient(aggregation):
    group, g = _group(5)
    cfg = GRPOConfig(beta=0.07, aggregation=aggregation, eps_low=0.1, eps_high=0.1)
    logps = [(-2.0 + 0.5 * torch.randn(len(r), generator=g, dtype=torch.float64)).requires_grad_()
             for r in group.responses]
    fn = group_loss_fn(group, cfg, advantages(group.rewards, cfg))
    terms = [fn(b, lp) for b, lp in enumerate(logps)]
    ours = sum(t for t, _ in terms)
    grads = torch.autograd.grad(ours, logps, allow_unused=True)
    ref = _written_out(logps, group, cfg)
    ref_grads = torch.autograd.grad(ref, logps, allow_unused=True)
    assert abs(float(ours) - float(ref)) <= 1e-14 * max(1.0, abs(float(ref)))
    for b, (a, r) in enumerate(zip(grads, ref_grads)):
        r = torch.zeros_like(logps[b]) if r is None else r
        assert torch.allclose(a, r, rtol=0, atol=1e-15), (b, a, r)
        masked = torch.tensor(group.loss_masks[b]) == 0
        assert bool((a[masked] == 0).all()) and (masked.all() or bool((a[~masked] != 0).any()))
    stats = [s for _, s in terms]
    assert [s["trained"] for s in stats] == [3, 0, 4, 4] and [s["tokens"] for s in stats] == [5, 3, 6, 4]
    assert sum(s["clipped"] for s in stats) > 0  # the clip is active on trained tokens
    for b, s in enumerate(stats):  # KL sums and clip counts over the trained tokens only
        keep = torch.tensor(group.loss_masks[b], dtype=torch.bool)
        d = torch.tensor(group.ref_logprobs[b], dtype=torch.float64) - logps[b].detach()
        assert math.isclose(s["kl_sum"], float((torch.exp(d) - d - 1)[keep].sum()), rel_tol=1e-12, abs_tol=1e-15)

    # a masked token's old and reference log-probs change nothing
    for b, mk in enumerate(group.loss_masks):
        for t, m in enumerate(mk):
            if not m:
                group.old_logprobs[b][t] += 7.0
                group.ref_logprobs[b][t] -= 5.0
    fn2 = group_loss_fn(group, cfg, advantages(group.rewards, cfg))
    again = sum(fn2(b, lp)[0] for b, lp in enumerate(logps))
    assert float(again) == float(ours)


def test_dpo_sums_the_trained_tokens():
    mask = [1, 0, 1, 1]
    assert dpo.masked_sum([-1.0, -2.0, -3.0, -4.0], mask) == -8.0
    assert dpo.masked_sum([-1.0, -2.0], None) == -3.0
    fn = dpo.surrogate_loss_fn({0: 0.5, 1: -0.5}, [mask, [0, 1]])
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64, requires_grad=True)
    loss, stats = fn(0, lp)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(loss) == 0.5 * -8.0 and g.tolist() == [0.5, 0.0, 0.5, 0.5]
    assert stats["trained"] == 3 and stats["tokens"] == 4
