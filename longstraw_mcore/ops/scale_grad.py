"""`scale_grad(x, s)`: x in the forward, s times the gradient in the backward. Used where a tensor is
computed identically on several ranks whose gradient contributions are then summed (a KV group's
replicated K/V projection and k-norm: parallel/kv_group.py), so the sum counts it once."""

from __future__ import annotations

import torch


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)
