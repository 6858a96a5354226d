"""Per-token log-probs of target tokens from hidden states, vocab-parallel and chunked over tokens.

logp[t] = -vocab_parallel_cross_entropy(output_layer(h[t]), y[t]): the log-softmax is computed
across TP ranks (max / sum all-reduced, target logit taken on the rank that owns it), so no rank
holds a full-vocabulary row. Tokens go `chunk` at a time and each chunk is recomputed in backward
(activation checkpointing), so at no point more than one chunk's `[chunk, V/tp]` logits exist.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(output_layer, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    logits, _ = output_layer(h)                                   # [c, B, V/tp]
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.to(work), y)


def token_logprobs(output_layer, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """hidden [S, B, Hd] (decoder output), targets [B, S] -> logp [B, S] (float32, float64 for f64 models)."""
    S = hidden.shape[0]
    y = targets.transpose(0, 1).contiguous()
    outs = []
    for s0 in range(0, S, chunk):
        h, yc = hidden[s0:s0 + chunk], y[s0:s0 + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk_logprobs, output_layer, h, yc, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(output_layer, h, yc))
    return torch.cat(outs, 0).transpose(0, 1)
