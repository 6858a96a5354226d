"""Triton's interpreter as a test mode: the project's Triton paths (flash-linear-attention's kernels, and
any of ours) run on CPU tensors, so every CI run holds them to their plain-torch twins at tiny shapes.

How: set `TRITON_INTERPRET=1` in the environment before the process imports Triton kernels (Triton
reads it when a `@triton.jit` decorator runs, i.e. when fla's modules are imported) and pass CPU
tensors; `install()` (called by ops/fla_gdn.py before it imports fla) then bridges the two places
where the interpreter of Triton 3.8 behaves unlike compiled Triton. Nothing in the kernels is changed:

1. Autotuning. `triton.autotune` benchmarks its configs through the active GPU driver, and under the
   interpreter there is none ("0 active drivers"). Bridged: the autotuner keeps the first config that
   survives the kernel's own pruning, so nothing is benchmarked (speed means nothing here, and every
   config computes the same numbers up to float rounding).
2. Loop indices. In a compiled kernel `for i in range(n)` (and `tl.range`) yields Triton scalars;
   the interpreter runs the kernel as Python and yields ints, and fla calls methods on them
   (`i_t.to(tl.int64)` in fla/ops/common/chunk_delta_h.py). Bridged: the interpreter's rewrite of each
   kernel's source also turns those loops into a range yielding int32 Triton scalars
   (`tl.static_range`, unrolled at compile time, keeps yielding ints as compiled Triton does).

Not bridged: bfloat16. The interpreter holds bf16 values as their uint16 bit patterns, and its `tl.dot`
and arithmetic on them operate on those integers (fla's rule on bf16 inputs came out 4e9 off; widening
the dot's operands alone still left NaNs); fp16 and fp32 are right. So the CPU tests run float32, and
bf16 is compared with the twins on the device (tests/gpu/test_fla_gdn.py).

The interpreter runs every program of the grid in turn with numpy: about a second per Gated DeltaNet
forward at T = 80, K = V = 32. Its numbers are the kernel's algorithm in float32 (or the inputs' dtype);
it does not reproduce GPU-specific miscompiles (fla issue #640), which only a device run can catch.

`active()`: whether Triton runs interpreted in this process. `install()`: apply the bridges
(idempotent; nothing happens unless active). `tensor_gap(x, noun)`: why a Triton kernel cannot take
tensors like `x` here (the device, the interpreter's bf16), or None.
"""

from __future__ import annotations

import ast

_installed = False
_RANGE_NAME = "_longstraw_interpreter_range"


def active() -> bool:
    """Triton is installed and in interpreter mode (`TRITON_INTERPRET=1` when its knobs were read)."""
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def tensor_gap(x, noun: str = "tensors") -> str | None:
    """What keeps a Triton kernel from tensors like `x` here, whatever the kernel: Triton missing, CPU tensors
    without the interpreter, bf16 on the CPU (the interpreter's bf16 is not bf16), another device. The
    kernel's own dtypes and limits are its caller's to check."""
    import importlib.util

    import torch

    if x.device.type == "cpu" and not active():
        return (f"{noun} are on the CPU and Triton is not interpreting "
                "(TRITON_INTERPRET=1 runs the kernels on CPU tensors)")
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        return (f"bf16 {noun} on the CPU "
                "(Triton's interpreter does not emulate bf16 arithmetic: ops/triton_interpret.py)")
    if x.device.type not in ("cpu", "cuda"):
        return f"{noun} are on {x.device.type}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _scalar_range(*bounds):
    """`range` over Python ints or interpreter scalars, yielding int32 Triton scalars as compiled
    Triton does. Runs inside a kernel, where the interpreter has patched `tl.full`."""
    import triton.language as tl

    ints = [int(b.handle.data.item()) if hasattr(b, "handle") else int(b) for b in bounds]
    for i in range(*ints):
        yield tl.full((), i, tl.int32)


def install() -> None:
    """Bridge the interpreter's gaps (module docstring) for this process; a no-op unless active."""
    global _installed
    if _installed or not active():
        return
    from triton.runtime import autotuner, interpreter

    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config

    base = interpreter.FunctionRewriter.ast_transformer

    class _LoopIndices(type(base)):
        """The interpreter's own rewrite, plus `range(...)` / `tl.range(...)` loops -> `_scalar_range`."""

        def visit_For(self, node):
            it = node.iter
            if isinstance(it, ast.Call) and ((isinstance(it.func, ast.Name) and it.func.id == "range")
                                             or (isinstance(it.func, ast.Attribute) and it.func.attr == "range")):
                it.func = ast.Name(id=_RANGE_NAME, ctx=ast.Load())
            self.generic_visit(node)
            return node

    interpreter.FunctionRewriter.ast_transformer = _LoopIndices()
    compile_and_exec = interpreter.FunctionRewriter._compile_and_exec

    def with_range(self, transformed_ast):
        self.fn.__globals__.setdefault(_RANGE_NAME, _scalar_range)  # the kernel module's namespace
        return compile_and_exec(self, transformed_ast)

    interpreter.FunctionRewriter._compile_and_exec = with_range

    _installed = True
