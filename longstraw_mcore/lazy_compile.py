"""Megatron-Core's `torch.compile` decorations compiled on first call instead of at import.

Megatron-Core decorates functions with `torch.compile` when its modules are imported: megatron/core/
jit.py binds `jit_fuser = torch.compile` for a dozen fusion modules, and transformer/moe/router.py uses
`@torch.compile` directly (`import megatron.core` imports them all). Decorating calls `torch.compile`,
which imports torch._dynamo and torch._inductor: 1-2 s of every process's start, mostly for functions a
CPU run never calls (its TransformerConfig turns the fusions off, cpu_compat.py). `install()` puts an import
hook in front of every `megatron.*` module: while one executes, `torch.compile` is `lazy(torch.compile)`,
which decorates without compiling; the function is compiled by the real `torch.compile`, with the same
arguments, at its first call, so a run that calls it behaves as before. Outside Megatron's module
bodies `torch.compile` is torch's own.

On the CPU (`run_eagerly()`, from cpu_compat.enable) those functions run uncompiled instead. Some are
called on every forward whatever the config (the MoE router's `_apply_expert_bias`): compiling them
costs seconds per process and, under cpu_compat's CUDA-to-CPU TorchFunctionMode, dynamo traces that
mode and recompiles 6 times (measured on a 4-rank GLM test: 27 s, 16.5 s with dynamo off). The
uncompiled function is the one Megatron wrote, the compiled one's reference.

Installed by longstraw_mcore/__init__.py (no torch import there); a process that imported megatron.core
before longstraw_mcore keeps Megatron's eager decoration. tests/unit/test_lazy_compile.py checks both
halves: `import megatron.core` after `import longstraw_mcore` does not import torch._inductor, and a
lazily decorated function gives the compiled function's result.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

PREFIX = "megatron."
_EAGER = False


def run_eagerly(on: bool = True) -> None:
    """Lazily decorated functions called from now on run uncompiled (on) or compile at first call."""
    global _EAGER
    _EAGER = on


def lazy(compile_fn):
    """A decorator with torch.compile's call forms (`@c`, `@c(**kw)`, `c(fn, **kw)`) that compiles at
    the first call."""

    def decorate(fn=None, **kwargs):
        if fn is None:
            return lambda f: decorate(f, **kwargs)
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kw):
            if _EAGER:
                return fn(*args, **kw)
            if not compiled:
                compiled.append(compile_fn(fn, **kwargs))
            return compiled[0](*args, **kw)

        call.__lazy_compile__ = True
        return call

    decorate.__wrapped_compile__ = compile_fn
    return decorate


class _Loader(importlib.abc.Loader):
    depth = 0
    real = None

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # get_source, get_data, get_resource_reader, ... (inspect, resources)
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        import torch

        cls = type(self)
        if cls.depth == 0:
            cls.real = torch.compile
            torch.compile = lazy(cls.real)
        cls.depth += 1
        try:
            self.inner.exec_module(module)
        finally:
            cls.depth -= 1
            if cls.depth == 0:
                torch.compile = cls.real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith(PREFIX):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Idempotent; a no-op once megatron.core is imported."""
    if "megatron.core" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
