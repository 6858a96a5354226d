"""The `memory` section: switches that trade time or precision for device memory, each modelled by
the planner (planner/memory.py) and leaving results unchanged (bit-identical; fp8 state: bounded error).
Where each is built: memory/ (recompute, state staging, fp8 blocks), train/ (optimizer offload)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from longstraw_mcore.config.errors import ConfigError, check_choices, check_ints


@dataclass(kw_only=True)
class MemoryConfig:
    recompute: Literal["none", "layer"] = "none"
    """layer: a replayed branch (and exact mode's recompute of a prompt chunk) keeps only each layer's input
    for the backward and runs the layer again in it (torch.utils.checkpoint, non-reentrant)."""
    state_offload: bool = False
    """The prompt state's position-sized tensors (K/V, MLA latents, index keys; exact mode's state gradients
    too) live in host memory (pinned on CUDA), and a layer's are brought to the device while it runs
    (needs recompute=layer: otherwise the backward would keep every layer's device copy). Gated DeltaNet's
    state, the same size at any prompt length, stays on the device."""
    state_dtype: Literal["model", "fp8"] = "model"
    """fp8: K/V and MLA latents stored as float8 e4m3 with a float32 scale per block of 128 values (1.031
    bytes per value), dequantized to the model dtype while their layer runs (needs recompute=layer and
    replay.mode=detached; not with float64 models). DSA's index keys stay in the model dtype: they choose
    the discrete top-k (rounded, they flip selections: memory/staging.py)."""
    optimizer_offload: bool = False
    """fp32 master weights and Adam moments in host memory and the update on the CPU: Megatron's
    HybridDeviceOptimizer inside its distributed optimizer (train.grad_reduction=step; the distributed
    optimizer is switched on with it) or host-resident shards (micro_step)."""
    grad_offload: bool = False
    """train.grad_reduction=micro_step: no full-size gradient on the device. Each parameter's gradient
    is copied to a host buffer (pinned on CUDA) the moment autograd completes it in a backward and its
    `.grad` freed; a micro-step's reduce-scatter brings it back one bucket (train.grad_bucket_mib) at a
    time, and the float32 shards it adds into live in host memory (memory/grad_stage.py)."""
    host_heap: Literal["system", "retain"] = "system"
    """What the process's C allocator does with freed host memory (memory/host_heap.py; CPU runs, where
    activations live there). system: glibc's default (a large block is its own mapping, returned when
    freed and faulted in again next step); retain: freed memory stays in the process for the next step
    (the counterpart of CUDA's caching allocator): no page faults in a steady loop, resident memory at
    the step's high-water mark (the planner's figures are live tensors, as CUDA's `allocated`)."""
    mla_query_block: int = 0
    """GLM's sparse MLA in replay and the exact sweep: queries in blocks of this many, each block's
    selected latents recomputed in its backward (activations O(block x top-k), not O(R x top-k));
    0: all queries at once."""

    def __post_init__(self):
        check_choices(self, "memory")
        check_ints(self, "memory", ("mla_query_block",), low=0, words="an integer >= 0 (0: one block)")
        for name in ("state_offload", "optimizer_offload", "grad_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"memory.{name}={getattr(self, name)!r}: must be true or false")
        staged = [n for n, on in (("memory.state_offload=true", self.state_offload),
                                  ("memory.state_dtype=fp8", self.state_dtype == "fp8")) if on]
        if staged and self.recompute != "layer":
            raise ConfigError(f"{' and '.join(staged)} needs memory.recompute=layer (got {self.recompute!r}): a "
                              "layer's state is on the device only while the layer runs, and without recompute "
                              "the backward would keep every layer's device copy")

    @property
    def stages_state(self) -> bool:
        """Whether a layer's prompt state is brought to the device (and dequantized) while it runs."""
        return self.state_offload or self.state_dtype == "fp8"

    def check_run(self, mode: str, dtype: str, grad_reduction: str = "micro_step", device: str = "auto") -> None:
        """What depends on other sections (RunConfig calls it)."""
        if self.optimizer_offload and grad_reduction == "step" and device == "cpu":
            raise ConfigError("memory.optimizer_offload with train.grad_reduction=step runs Megatron-Core's "
                              "HybridDeviceOptimizer, which offloads CUDA parameters only; with device=cpu use "
                              "train.grad_reduction=micro_step (its shards in host memory) or optimizer_offload=false")
        if self.grad_offload and grad_reduction != "micro_step":
            raise ConfigError(f"memory.grad_offload with train.grad_reduction={grad_reduction!r}: Megatron DDP keeps a "
                              "full-size gradient buffer on the device by construction; use train.grad_reduction="
                              "micro_step (gradients staged in host memory, reduce-scattered bucket by bucket)")
        if self.state_dtype == "fp8" and dtype == "float64":
            raise ConfigError("memory.state_dtype=fp8 with model.dtype=float64: fp8 state is for bf16/fp32 runs "
                              "(float64 runs are the exactness references); use state_dtype=model")
        if self.state_dtype == "fp8" and mode == "exact":
            raise ConfigError("memory.state_dtype=fp8 with replay.mode=exact: exact mode keeps a float32 gradient "
                              "of every state value, which fp8 storage would not shrink, and differentiates "
                              "through the rounded state; use replay.mode=detached or state_dtype=model")
