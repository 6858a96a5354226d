"""Tensor-parallel LoRA on Megatron's parallel linears: y = W x + s B A x, s = alpha / rank (PEFT's).

Shapes: x [T, B, in] (Megatron's sequence-first activations), A [r, in], B [out, r]; on a TP rank the
base holds its shard of W, and the adapter the matching shard:

    base (Megatron)                 A                     B                  TP mapping on h = A x
    column, output split            replicated [r, in]    rows [out/tp, r]   copy (backward: all-reduce)
    column, output gathered         replicated            replicated         none
    row, input split                columns [r, in/tp]    replicated         reduce (forward: all-reduce)
    ... with sequence parallelism   as above              as above           gather / reduce-scatter by sequence
    expert (expert TP of 1)         whole                 whole              none

so every rank computes only its rows of the output (column) or its columns' share of h (row), and the
gradients of A and B come out complete: the all-reduce in copy's backward sums the partial gradients
of h that each rank's rows of B produce; reduce's forward sums the ranks' partial h. Replicated
factors get identical gradients on every TP rank (like Megatron's replicated norms); split ones are
marked `tensor_model_parallel` so gradient norms count them once. Under sequence parallelism (GLM's
MoE layer at tp > 1: models/glm_moe.py) a rank sees only its tokens, so the replicated factor's
gradient is summed over TP as autograd produces it.

A fused Megatron projection holds one adapter per Hugging Face module (`slots`): linear_fc1 = [gate;
up] has the gate_proj and the up_proj adapters, each rank's output [gate rows; up rows] is matched by
[its rows of B_gate; of B_up]; one HF module split over several Megatron projections (Gated
DeltaNet's in_proj_qkv over in_proj_q/k/v) shares its A, and each projection holds its rows of B.

The adapter term is added by a forward hook on the base projection (nothing in Megatron is forked);
a projection whose weight a mixer uses directly (MLA's absorbed kv_b_proj) asks `effective_weight`.
`LoRA.active` switches every adapter of a model off and on (`adapter.prompt=frozen`: the prompt
positions run the base only).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

KINDS = ("column", "gathered", "row", "expert")


class Switch:
    """Whether the adapters of one model act (shared by all its LoRA modules)."""

    def __init__(self):
        self.on = True


class LoRA(torch.nn.Module):
    """One Hugging Face module's adapter as this rank holds it: `A` [r, in or in/tp], and one factor of
    B per Megatron projection it spans (`B[part]`, this rank's rows)."""

    def __init__(self, name: str, A: torch.Tensor, parts: dict[str, torch.Tensor], scale: float, kind: str,
                 switch: Switch):
        super().__init__()
        self.name, self.scale, self.kind, self.switch = name, scale, kind, switch
        self.A = torch.nn.Parameter(A)
        self.B = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in parts.items()})
        if kind == "row":
            set_tensor_model_parallel_attributes(self.A, is_parallel=True, dim=1, stride=1)
        if kind == "column":
            for b in self.B.values():
                set_tensor_model_parallel_attributes(b, is_parallel=True, dim=0, stride=1)
        if kind == "expert":  # Megatron DDP and the optimizer treat them as expert parameters
            for p in (self.A, *self.B.values()):
                p.allreduce = False

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class Slot:
    lora: LoRA
    part: str
    index: int = 0


def _sequence_parallel(linear) -> bool:
    tp_group = linear.tp_group
    return getattr(linear, "sequence_parallel", False) and tp_group is not None and tp_group.size() > 1


def _replicated(p: torch.Tensor, linear) -> torch.Tensor:
    """A factor replicated over TP as the projection uses it: under sequence parallelism each rank sees
    only its tokens, so the factor's gradient is summed over TP (forward identity)."""
    return mappings.copy_to_tensor_model_parallel_region(p, group=linear.tp_group) if _sequence_parallel(linear) else p


def _h(x: torch.Tensor, lora: LoRA, linear) -> torch.Tensor:
    """h = A x with the layer's TP mapping, in the layout B consumes."""
    tp_group = linear.tp_group
    tp = tp_group.size() if tp_group is not None else 1
    sp = _sequence_parallel(linear)
    A = _replicated(lora.A, linear) if lora.kind == "column" else lora.A
    h = torch.nn.functional.linear(x, A.to(x.dtype))
    if lora.kind == "column" and tp > 1:
        return mappings.gather_from_sequence_parallel_region(h, group=tp_group) if sp else \
            mappings.copy_to_tensor_model_parallel_region(h, group=tp_group)
    if lora.kind == "row" and tp > 1:
        return mappings.reduce_scatter_to_sequence_parallel_region(h, group=tp_group) if sp else \
            mappings.reduce_from_tensor_model_parallel_region(h, group=tp_group)
    return h


def _b(slot: Slot, linear) -> torch.Tensor:
    b = slot.lora.B[slot.part]
    return _replicated(b, linear) if slot.lora.kind == "row" else b


def adapter_hook(slots: list[Slot], pieces: int = 1):
    """Forward hook for a Megatron projection holding `slots`; its output is `pieces` equal blocks of
    rows (fused linear_fc1: [gate; up]), a slot's term goes to its block (zeros where no adapter)."""

    def hook(linear, args, output):
        if not slots[0].lora.switch.on:
            return output
        out, bias = output if isinstance(output, tuple) else (output, None)
        x = args[0]
        by = {s.index: s.lora.scale * torch.nn.functional.linear(_h(x, s.lora, linear), _b(s, linear).to(x.dtype))
              for s in slots}
        if pieces == 1:
            delta = by[0]
        else:
            n = out.shape[-1] // pieces
            delta = torch.cat([by[i] if i in by else out.new_zeros(*out.shape[:-1], n) for i in range(pieces)], -1)
        if delta.shape != out.shape:
            raise RuntimeError(f"adapter {[s.lora.name for s in slots]}: output {tuple(delta.shape)} does not match "
                               f"the projection's {tuple(out.shape)}")
        out = out + delta
        return (out, bias) if isinstance(output, tuple) else out

    return hook


def effective_weight(linear) -> torch.Tensor:
    """The weight a mixer uses directly (W, or W + s B A with this rank's rows of B: MLA's absorbed
    kv_b_proj). A is replicated over TP and each rank's rows see it: its gradient is summed over TP."""
    from longstraw_mcore.adapters.quant import dense_weight

    slots = getattr(linear, "adapter_slots", None)
    w = dense_weight(linear)
    if not slots or not slots[0].lora.switch.on:
        return w
    (s,) = slots
    A = s.lora.A
    tp_group = linear.tp_group
    if tp_group is not None and tp_group.size() > 1:
        A = mappings.copy_to_tensor_model_parallel_region(A, group=tp_group)
    return w + s.lora.scale * (s.lora.B[s.part] @ A).to(w.dtype)


def init_a(name: str, rank: int, n_in: int, seed: int) -> torch.Tensor:
    """PEFT's default A (kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn in full
    from a generator keyed by (seed, module name), so every layout starts from the same adapter."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    bound = 1.0 / math.sqrt(n_in)
    return torch.empty(rank, n_in, dtype=torch.float64).uniform_(-bound, bound, generator=g)
