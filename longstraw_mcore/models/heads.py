"""What the last stage puts on the final norm's output: the language-model head, or a scalar head.

    lm              the output layer (vocab-parallel logits) -> log-probs of the targets (loss/logprobs.py)
    token_value     a critic: `score` = Linear(hidden, 1) with a bias (transformers' token-classification
                    layout with one label, `Qwen3_5ForTokenClassification`) -> one value per position
    sequence_score  a reward model: `score` = Linear(hidden, 1) without a bias (the sequence-classification
                    layout, `Qwen3_5ForSequenceClassification`) -> one score per position; the reward is the
                    last token's

A scalar head is one small matrix: every tensor-parallel rank holds it whole and computes the same values
from the same (replicated) hidden states, so its gradient needs no tensor-parallel reduction, and the
gradient norm counts it once (it is not marked tensor-parallel). Values are computed in float32 (float64
for float64 models), like log-probs.
"""

from __future__ import annotations

import torch

HEADS = ("lm", "token_value", "sequence_score")


class ScalarHead(torch.nn.Module):
    """Linear(hidden, 1): returns (out [..., 1], None), the signature of Megatron's linear layers."""

    def __init__(self, hidden: int, bias: bool, dtype, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, h: torch.Tensor):
        return torch.nn.functional.linear(h, self.weight, self.bias), None


def make_head(kind: str, hidden: int, dtype):
    if kind not in HEADS[1:]:
        raise ValueError(f"head {kind!r}: expected one of {HEADS}")
    return ScalarHead(hidden, bias=kind == "token_value", dtype=dtype)


def token_values(head: ScalarHead, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [S, B, Hd] -> values [B, S] (float32; float64 for float64 models)."""
    work = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out, _ = head(hidden)
    return out[..., 0].to(work).transpose(0, 1)
