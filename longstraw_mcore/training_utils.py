"""Small helpers over a TP/PP-sharded model: global parameter count and gradient norm.

A parameter that is replicated across the TP group (norms) is counted once (on TP rank 0);
TP-sharded ones are summed over the TP group; stages are summed over the PP group. Data-parallel
replicas hold the same values and are not summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _owned(p) -> bool:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    return param_is_not_tensor_parallel_duplicate(p)


def _sum_over_model_parallel(x: torch.Tensor, par) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x, group=par.pgs.tp)
        if par.pp > 1:
            dist.all_reduce(x, group=par.pgs.pp)
    return x


def count_parameters(model, par) -> int:
    n = torch.tensor([sum(p.numel() for p in model.parameters() if _owned(p))], dtype=torch.float64)
    return int(_sum_over_model_parallel(n, par).item())


def grad_norm(model, par) -> float:
    sq = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        g = getattr(p, "main_grad", None) if p.grad is None else p.grad
        if g is not None and _owned(p):
            sq += g.detach().double().pow(2).sum()
    return float(_sum_over_model_parallel(sq, par).sqrt().item())
