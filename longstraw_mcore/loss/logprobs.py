"""Per-token log-probs of target tokens from hidden states, vocab-parallel and chunked over tokens.

    logp[t] = z[t, y_t] - logsumexp_v z[t, v],   z = output_layer(h)   (each TP rank holds V/tp columns)

The max and the sum of exponentials are all-reduced across the TP group and the target logit is
taken on the rank that owns it, so no rank ever holds a full-vocabulary row. Computed in float32
(float64 for float64 models: unlike Megatron's vocab_parallel_cross_entropy, which always casts to
float32). Tokens go `chunk` at a time and each chunk is recomputed in backward (activation
checkpointing), so at most one chunk's `[chunk, B, V/tp]` logits exist at any time.

With a padded vocabulary (Megatron's `make_vocab_size_divisible_by`: the output layer has
V_pad >= V rows so that TP divides it), `vocab_size=V` masks the padded columns to -inf before the
max and the sum: they never reach a log-prob, and their logits get exactly zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


def vocab_parallel_logprobs(logits_local: torch.Tensor, target: torch.Tensor, tp_group,
                            vocab_size: int | None = None) -> torch.Tensor:
    """logits_local [..., V_pad/tp] (this rank's vocab slice), target [...] global ids -> log-probs [...].

    `vocab_size`: the true vocabulary; columns at or beyond it (padding) are excluded."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    work = torch.float64 if logits_local.dtype == torch.float64 else torch.float32
    z = logits_local.to(work)
    tp = 1 if tp_group is None else tp_group.size()
    vloc = z.shape[-1]
    start = (0 if tp == 1 else tp_group.rank()) * vloc
    if vocab_size is not None and start + vloc > vocab_size:
        pad = torch.arange(start, start + vloc, device=z.device) >= vocab_size
        z = z.masked_fill(pad, float("-inf"))
    m = z.detach().amax(-1, keepdim=True)                       # a shift: no gradient needed
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - m
    local = (target >= start) & (target < start + vloc)
    idx = torch.where(local, target - start, torch.zeros_like(target))
    picked = torch.where(local, shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1), torch.zeros((), dtype=work, device=z.device))
    sumexp = shifted.exp().sum(-1)
    if tp > 1:
        picked = reduce_from_tensor_model_parallel_region(picked, group=tp_group)
        sumexp = reduce_from_tensor_model_parallel_region(sumexp, group=tp_group)
    return picked - torch.log(sumexp)


def _chunk_logprobs(output_layer, h: torch.Tensor, y: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    logits, _ = output_layer(h)                                   # [c, B, V_pad/tp]
    return vocab_parallel_logprobs(logits, y, getattr(output_layer, "tp_group", None), vocab_size)


def token_logprobs(output_layer, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                   vocab_size: int | None = None) -> torch.Tensor:
    """hidden [S, B, Hd] (decoder output), targets [B, S] -> logp [B, S] (float32, float64 for f64 models).

    `vocab_size`: the true vocabulary when the output layer is padded beyond it."""
    S = hidden.shape[0]
    y = targets.transpose(0, 1).contiguous()
    outs = []
    for s0 in range(0, S, chunk):
        h, yc = hidden[s0:s0 + chunk], y[s0:s0 + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk_logprobs, output_layer, h, yc, vocab_size, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(output_layer, h, yc, vocab_size))
    return torch.cat(outs, 0).transpose(0, 1)
