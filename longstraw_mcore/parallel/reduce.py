"""Scalar reductions over process groups, with the tensors that travel on the run's device.

NCCL collectives take CUDA tensors only, gloo CPU ones: an accumulator allocated without naming
the device crashes the first CUDA run that reduces it (found in grad_norm, count_parameters, the
trainer's metrics and smoke's loss). So every scalar reduction of the library goes through here:
callers hand over Python numbers (or tensors already on the device) plus the device, and the tensor
that is reduced is built here, on that device. tests/dist/test_reduce_devices.py runs these and a
whole train step with the default device set to `meta`: anything created without naming the run's
device lands there and fails.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def _reduce(values: Sequence[float], group, device, op) -> list[float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_sum(values: Sequence[float], group, device) -> list[float]:
    """Element-wise sum of `values` over `group` (float64)."""
    return _reduce(values, group, device, dist.ReduceOp.SUM)


def all_reduce_max(values: Sequence[float], group, device) -> list[float]:
    return _reduce(values, group, device, dist.ReduceOp.MAX)


def model_parallel_sum(values: Sequence[float], par) -> list[float]:
    """Sum over the tensor- and pipeline-parallel groups: one model replica's total."""
    out = all_reduce_sum(values, par.pgs.tp, par.device)
    return all_reduce_sum(out, par.pgs.pp, par.device) if par.pp > 1 else out


def _owned(p) -> bool:
    """Count a TP-replicated parameter (norms) once: on TP rank 0."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    return param_is_not_tensor_parallel_duplicate(p)


def count_parameters(model, par) -> int:
    """Parameters of the whole model (TP shards summed, replicated ones once, stages summed)."""
    return int(model_parallel_sum([sum(p.numel() for p in model.parameters() if _owned(p))], par)[0])


def grad_norm(model, par) -> float:
    """L2 norm of the whole model's gradient (`.grad`, or Megatron DDP's `main_grad`), in float64 on
    the device; data-parallel replicas hold the same values and are not summed. Routed experts
    (Megatron marks them `allreduce = False`) are whole on their expert-parallel rank, each EP rank
    holding others: their squares are summed over the EP group (then over the pipeline stages), the
    other parameters' over tensor and pipeline parallel (TP-replicated ones counted once)."""
    dense = torch.zeros((), dtype=torch.float64, device=par.device)
    expert = torch.zeros((), dtype=torch.float64, device=par.device)
    for p in model.parameters():
        g = getattr(p, "main_grad", None) if p.grad is None else p.grad
        if g is None:
            continue
        if not getattr(p, "allreduce", True):
            expert += g.detach().to(torch.float64).pow(2).sum()
        elif _owned(p):
            dense += g.detach().to(torch.float64).pow(2).sum()
    # .item(): the sums of squares travel as numbers
    total = model_parallel_sum([dense.item()], par)[0]
    ep = getattr(par.pgs, "ep", None)
    experts = all_reduce_sum([expert.item()], ep, par.device)[0] if ep is not None else expert.item()
    experts = all_reduce_sum([experts], par.pgs.pp, par.device)[0] if par.pp > 1 else experts
    return (total + experts) ** 0.5
