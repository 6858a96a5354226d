"""RMSNorms of the Qwen3.6 family, shaped for Megatron `ModuleSpec` slots.

- `ZeroCenteredRMSNorm`: y = x / rms(x) * (1 + w), w initialised to 0 (Qwen3.5/3.6 layer, final and
  q/k norms). Computed in float32 (float64 under float64), cast back, as the reference does.
- `GatedRMSNorm`: y = (w * (x / rms(x))) * silu(z) (Gated DeltaNet output norm; w initialised to 1).
- `SigmoidGatedRMSNorm`: y = w * (x / rms(x)) * sigmoid(z), all in float32 or wider (Kimi Delta Attention's
  output norm, GLM-5.3-Flash: the weight is applied before the cast back, unlike Gated DeltaNet's).

A norm applied to a *head-sharded* tensor under tensor parallelism (attention q/k norms, the GDN
output norm) sees only its rank's heads, so its weight gradient is partial per rank. Such norms are
built with `tp_group` and pass the weight through `copy_to_tensor_model_parallel_region`, whose
backward all-reduces: the weight gradient is complete right after `backward()`, with no reliance on
`finalize_model_grads` name matching. A norm whose input is computed identically on `replicas` TP
ranks (the k-norm of a KV head shared by a KV group: parallel/kv_group.py) scales its weight
gradient by 1/replicas, so the all-reduce counts that head once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from longstraw_mcore.ops.scale_grad import scale_grad


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tp_weight(weight: torch.Tensor, tp_group, replicas: int = 1) -> torch.Tensor:
    if tp_group is None or tp_group.size() == 1:
        return weight
    w = copy_to_tensor_model_parallel_region(weight, group=tp_group)
    return scale_grad(w, 1.0 / replicas)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Megatron norm-slot signature: `(config, hidden_size, eps)`; weight stored as HF stores it."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, tp_group=None, dtype=None,
                 replicas: int = 1, **kwargs):
        super().__init__()
        dtype = dtype or (config.params_dtype if config is not None else torch.float32)
        self.eps = eps
        self.tp_group, self.replicas = tp_group, replicas
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = _work_dtype(x.dtype)
        h = x.to(work)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = _tp_weight(self.weight, self.tp_group, self.replicas)
        return (h * (1.0 + w.to(work))).to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, tp_group=None, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        work = _work_dtype(x.dtype)
        h = x.to(work)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Order as the reference: normalise in float32, cast, scale by w, gate by silu(z) in float32.
        h = _tp_weight(self.weight, self.tp_group) * h.to(x.dtype)
        return (h * F.silu(z.to(work))).to(x.dtype)


class SigmoidGatedRMSNorm(GatedRMSNorm):
    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        work = _work_dtype(x.dtype)
        h = x.to(work)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = _tp_weight(self.weight, self.tp_group).to(work) * h
        return (h * torch.sigmoid(z.to(work))).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Plain RMSNorm (GLM-5.x / DeepSeek: weight x normalised, weight starting at ones), normalised in
    >= float32 and cast back before the weight, as the reference orders it. Megatron norm-slot
    signature `(config, hidden_size, eps)`; an input replicated over TP keeps a replicated weight."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, dtype=None, **kwargs):
        super().__init__()
        dtype = dtype or (config.params_dtype if config is not None else torch.float32)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_work_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
