"""Which attention kernel `ops.attention` runs, and which Gated DeltaNet rule `ops.gdn` would take, from
names alone (no torch import: the planner asks them for a run's config, ops/dispatch.py the first for
the tensors it is handed)."""

from __future__ import annotations

CPU_DTYPES = ("float64", "float32", "bfloat16", "float16")
"""torch's fused CPU op (`_scaled_dot_product_flash_attention_for_cpu`) runs every float dtype (bf16 /
fp16 inputs in float32 here, the twin's work dtype)."""
CUDA_DTYPES = ("bfloat16", "float16")
CUDA_MAX_HEAD_DIM = 256
FLA_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes flash-linear-attention's kernels take (ops/fla_gdn.DTYPES)."""


def attention_kernel_name(choice: str, device: str, dtype: str, head_dim: int, value_head_dim: int | None = None,
                          planner: bool = False) -> str:
    """"flash" or "plain": what `choice` (auto / plain / flash) runs for queries on `device` ("cpu" /
    "cuda") in `dtype` (its name: "bfloat16") with `head_dim`. flash: torch's op wherever it applies:
    every CPU float dtype where the values' head dim is the queries' (ops/flash_attention.py: the CPU op
    needs them equal), CUDA bf16 / fp16 with head dim <= 256 (flash where it does not apply is the
    caller's error: ops/dispatch.py raises); auto: the same. plain: the twin. `planner`: "flash_cpu"
    for the CPU op, whose bf16 / fp16 work runs in float32 copies (the memory terms differ)."""
    if choice == "plain":
        return "plain"
    if device == "cpu":
        ok = dtype in CPU_DTYPES and (value_head_dim is None or value_head_dim == head_dim)
    elif device == "cuda":
        ok = dtype in CUDA_DTYPES and head_dim <= CUDA_MAX_HEAD_DIM
    else:
        ok = False
    return ("flash_cpu" if planner and device == "cpu" else "flash") if ok else "plain"


def gdn_kernel_name(choice: str, device: str, dtype: str) -> str:
    """"fla" or "plain": the Gated DeltaNet rule `choice` (auto / plain / fla) takes on `device` in
    `dtype`, as ops/dispatch.gdn_kernel would where flash-linear-attention is installed (the `gpu` extra;
    the dispatch checks that, and fla's own limits, on the tensors): auto takes fla for CUDA bf16 / fp16 /
    fp32 (ops/fla_gdn.py)."""
    if choice == "plain":
        return "plain"
    return "fla" if choice == "fla" or (device == "cuda" and dtype in FLA_DTYPES) else "plain"


DSA_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes the DSA kernels take (ops/dsa_triton_*.py); float64 is the twins'."""


def dsa_kernel_name(choice: str, device: str, dtype: str) -> str:
    """"triton" or "plain": what ops.dsa's `choice` (auto / plain / triton) runs on `device` in `dtype`, as
    ops/dispatch.dsa_kernel would where Triton is installed (the dispatch checks that on the tensors):
    auto takes the kernels for CUDA bf16 / fp16 / fp32."""
    if choice == "plain":
        return "plain"
    return "triton" if choice == "triton" or (device == "cuda" and dtype in DSA_DTYPES) else "plain"
