"""QLoRA's frozen base: each projection's weight stored quantized, dequantized where it is used.

    nf4   torchao's NF4Tensor (blocks of 64 with double-quantized scales): 0.516 bytes per weight
          (measured on a 1024 x 1024 block; more on tiny projections: smaller scale blocks, padding)

Both quantize the projection's shard flattened in row-major order, in blocks (the last one padded
with zeros), so any shape quantizes.
    fp8   float8 e4m3 with a float32 scale per block of 128 weights (amax / 448): 1.031 bytes per weight

The Megatron projection keeps its TP mappings (input copy / all-gather, output all-reduce /
reduce-scatter: its own forward); only its matmul is replaced (`_forward_impl`), by an autograd
function that keeps the quantized weight for the backward (never a dequantized copy: one
projection's weight is dequantized for its product and dropped) and computes no weight gradient.
The parameter `weight` becomes an empty placeholder, so the model holds the quantized bytes only. A
projection a mixer reads directly (MLA's absorbed kv_b_proj) dequantizes in `dense_weight`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from longstraw_mcore.config import ConfigError

FP8_BLOCK, FP8_MAX = 128, 448.0


class QuantizedWeight:
    """One projection's frozen weight [out, in] in `kind` (nf4 | fp8), and its dequantization."""

    def __init__(self, w: torch.Tensor, kind: str, where: str):
        self.kind, self.shape, self.dtype = kind, tuple(w.shape), w.dtype
        if kind == "nf4":
            from torchao.quantization import to_nf4

            n = w.numel()
            if w.dim() != 2:
                raise ConfigError(f"adapter.base_dtype=nf4: {where} is not a matrix {list(w.shape)}")
            flat = torch.nn.functional.pad(w.detach().reshape(-1), (0, (-n) % 64))  # zeros past the last block
            blocks = flat.numel() // 64
            scaler = max(d for d in range(1, 257) if blocks % d == 0)  # torchao's 256, or what divides
            self.data = to_nf4(flat.view(blocks, 64), 64, scaler)
        elif kind == "fp8":
            flat = w.detach().float().reshape(-1)
            x = torch.nn.functional.pad(flat, (0, (-flat.numel()) % FP8_BLOCK)).view(-1, FP8_BLOCK)
            self.scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            self.data = (x / self.scale).to(torch.float8_e4m3fn)
        else:
            raise ValueError(kind)

    def dequantize(self, dtype=None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.kind == "nf4":
            n = self.shape[0] * self.shape[1]
            return self.data.get_original_weight().reshape(-1)[:n].view(self.shape).to(dtype)
        n = self.shape[0] * self.shape[1]
        return (self.data.float() * self.scale).reshape(-1)[:n].view(self.shape).to(dtype)

    def nbytes(self) -> int:
        if self.kind == "nf4":
            names = self.data.__tensor_flatten__()[0]
            return sum(getattr(self.data, n).numel() * getattr(self.data, n).element_size() for n in names)
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


class _QuantizedMatmul(torch.autograd.Function):
    """y = x W^T with W dequantized for the product; backward: dx = g W (all-reduced over TP where
    Megatron's column-parallel input copy asks it), no dW."""

    @staticmethod
    def forward(ctx, x, q: QuantizedWeight, allreduce_dgrad: bool, tp_group):
        ctx.q, ctx.allreduce_dgrad, ctx.tp_group = q, allreduce_dgrad, tp_group
        return x @ q.dequantize(x.dtype).t()

    @staticmethod
    def backward(ctx, g):
        gi = g @ ctx.q.dequantize(g.dtype)
        if ctx.allreduce_dgrad:
            dist.all_reduce(gi, group=ctx.tp_group)
        return gi, None, None, None


def _forward_impl(q: QuantizedWeight):
    def impl(input, weight, bias, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
             tp_group=None, **kwargs):
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        out = _QuantizedMatmul.apply(input, q, bool(allreduce_dgrad), tp_group)
        return out + bias if bias is not None else out

    return impl


def quantize(linear, kind: str, where: str) -> int:
    """Replace `linear`'s weight by its quantized form (in place); returns the quantized bytes."""
    q = QuantizedWeight(linear.weight.data, kind, where)
    linear.qweight = q
    linear._forward_impl = _forward_impl(q)
    linear.weight = torch.nn.Parameter(torch.empty(0, dtype=q.dtype, device=linear.weight.device), requires_grad=False)
    return q.nbytes()


def dense_weight(linear) -> torch.Tensor:
    """The projection's weight as a dense tensor (dequantized when the base is quantized)."""
    q = getattr(linear, "qweight", None)
    return linear.weight if q is None else q.dequantize()
