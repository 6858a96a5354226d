"""longstraw_mcore/lazy_compile.py: after `import longstraw_mcore`, `import megatron.core` (and the
modules a run imports: models, optimizer, the MoE router, the pipeline schedules) leaves torch._dynamo
and torch._inductor unimported, Megatron's decorations wrap torch's own `torch.compile`, and
`torch.compile` is torch's again afterwards; on the CPU (cpu_compat.enable) such a function runs
uncompiled (Megatron's gelu: its own formula, nothing compiled); elsewhere a lazily decorated function
compiles once, at its first call, with the decoration's arguments, and returns what the compiled
function returns."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = """
import sys, torch
real = torch.compile
import longstraw_mcore
import megatron.core, megatron.core.models.gpt, megatron.core.optimizer, megatron.core.pipeline_parallel
import megatron.core.transformer.moe.router as router
import megatron.core.jit as jit
assert 'torch._inductor' not in sys.modules and 'torch._dynamo' not in sys.modules, 'compiled at import'
assert torch.compile is real
assert jit.jit_fuser.__wrapped_compile__ is real
assert router.InferenceTopKRouter._compiled_topk_routing.__lazy_compile__
import inspect
assert "def _apply_expert_bias" in inspect.getsource(router.TopKRouter)  # the loader still serves sources
from longstraw_mcore import cpu_compat
from megatron.core.transformer.utils import gelu_impl
cpu_compat.enable("cpu")
x = torch.linspace(-3, 3, 7, dtype=torch.float64)
assert torch.equal(gelu_impl(x), 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x))))
assert 'torch._dynamo' not in sys.modules, 'compiled on the CPU'
print('ok')
"""


def test_megatron_imports_without_compiling_and_compiles_on_first_call():
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]

    from longstraw_mcore import lazy_compile
    from longstraw_mcore.lazy_compile import lazy

    was = lazy_compile._EAGER  # (another test may have enabled the CPU patches in this process)
    lazy_compile.run_eagerly(False)
    try:
        _lazy_then_eager(lazy, lazy_compile)
    finally:
        lazy_compile.run_eagerly(was)


def _lazy_then_eager(lazy, lazy_compile):
    calls = []

    def fake_compile(fn, **kw):
        calls.append((fn.__name__, kw))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    c = lazy(fake_compile)

    @c
    def f(x, y=1):
        return x + y

    @c(dynamic=True)
    def g(x):
        return 2 * x

    h = c(lambda x: -x, mode="max-autotune")
    assert calls == [] and f.__name__ == "f"
    assert f(1, y=2) == ("compiled", 3) and f(5) == ("compiled", 6)
    assert g(3) == ("compiled", 6) and h(4) == ("compiled", -4)
    assert calls == [("f", {}), ("g", {"dynamic": True}), ("<lambda>", {"mode": "max-autotune"})]

    lazy_compile.run_eagerly(True)
    k = c(lambda x: x * 3)
    assert k(2) == 6 and f(1) == 2 and len(calls) == 3  # uncompiled, and nothing compiled
