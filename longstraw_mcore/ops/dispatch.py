"""Which kernel an op runs. One function per op picks it from the tensors' device and dtype and the
run's choice (`ops.*` in a run config, applied by `configure`):

    attention   auto: flash (ops/flash_attention.py, torch's fused ops that return the log-sum-exp) on
                CPU for every float dtype (torch's fused CPU op; bf16 / fp16 run in float32; a key set
                whose values have another head dim than the queries runs the twin, per call) and on
                CUDA for bf16 / fp16 with head dim <= 256, the plain-torch twin (ops/block_attention.py)
                otherwise; plain: the twin everywhere; flash: flash, and an error where it cannot run
                (comparisons must not silently measure the twin). tests/unit/test_flash_adapter.py and
                test_block_attention.py hold the op to the twin; ops/kernel_choice.py names the kernel
                for the planner too (its memory terms follow the kernel that runs)
    gdn         auto: flash-linear-attention (ops/fla_gdn.py) for CUDA bf16 / fp16 where fla is installed
                (the `gpu` extra), the plain chunked rule otherwise; plain / fla force one

`override(attention="plain")` switches for a block (tests, benchmarks comparing kernels).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from longstraw_mcore.config import OpsConfig
from longstraw_mcore.ops import block_attention, fla_gdn, flash_attention, gated_delta
from longstraw_mcore.ops.kernel_choice import attention_kernel_name

_choice = OpsConfig()


def configure(ops: OpsConfig) -> None:
    """Apply a run config's `ops` section for this process (checked when the config was built)."""
    global _choice
    _choice = ops


@contextmanager
def override(**choices):
    """Other choices for a block; checked like the config's (a bad name or value raises ConfigError)."""
    global _choice
    before = _choice
    _choice = dataclasses.replace(before, **choices)
    try:
        yield
    finally:
        _choice = before


def attention_kernel(q):
    """The partial kernels (partial_forward / partial_backward) for queries `q`."""
    c = _choice.attention
    name = attention_kernel_name(c, q.device.type, str(q.dtype).removeprefix("torch."), q.shape[-1])
    ok = name == "flash" and flash_attention.available(q)
    if c == "flash" and not ok:
        raise ValueError(f"ops.attention=flash needs CPU queries, or CUDA bf16/fp16 queries with head dim <= 256, and "
                         f"torch's flash op; got {q.device.type} {q.dtype}, head dim {q.shape[-1]} (use ops.attention=auto)")
    return flash_attention if ok else block_attention


def gdn_kernel(v):
    """The module whose `chunk_gated_delta_rule` runs for values `v`."""
    c = _choice.gdn
    if c == "plain":
        return gated_delta
    why = None if fla_gdn.supports(v) else f"values are {v.device.type} {v.dtype}"
    why = why or fla_gdn.missing()
    if c == "fla" and why:
        raise ValueError(f"ops.gdn=fla needs CUDA bf16/fp16 values, flash-linear-attention (the gpu extra) and "
                         f"triton >= 3.7.1: {why} (use ops.gdn=auto)")
    return fla_gdn if why is None else gated_delta
