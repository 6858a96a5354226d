"""Which Gated DeltaNet kernel transformers' Qwen3.5/3.6 model runs, chosen on purpose rather than by
what happens to be installed.

transformers 5.x binds the rule when `modeling_qwen3_5` is first imported: its
`use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")` takes flash-linear-
attention's function whenever `import fla` succeeds, on any device, and its own torch rule otherwise.
The test environment holds fla (the Triton interpreter tests), so an unguarded import would make the
numerical reference the very kernel it is meant to check. Hence:

    qwen3_5_modeling(fla=False)   the module, first imported with `fla` unimportable (sys.modules["fla"]
                                  = None for the duration of that import only): the torch rule
    qwen3_5_modeling(fla=True)    the module as transformers binds it with fla importable (the GPU
                                  side-by-side: transformers with its fast path)
    gdn_path(module)              "fla" or "torch": what the module bound, read back from the binding
    fast_path(device_type)        whether a peer run of transformers on that device takes fla (CUDA with fla
                                  installed: its own fast path), for the side-by-side tools
    torch_rule(module)            transformers' own torch rule whatever was bound (the module's
                                  `torch_chunk_gated_delta_rule` is the wrapper that forwards to the binding)
    glm5_next_modeling(fla)       the same for GLM-5.3-Flash's Kimi Delta Attention (`chunk_kimi_delta_attention`
                                  and `recurrent_kimi_delta_attention`, both bound at its import)

Both raise if the module was already imported with the other binding (a second import cannot rebind
it), so a reference can never silently run fla. tests/conftest.py imports the torch binding first
in every test process; tests/unit/test_hf_kernels.py checks it with fla installed.
"""

from __future__ import annotations

import importlib
import inspect
import sys

_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"


def fast_path(device_type: str) -> bool:
    """transformers' fast Gated DeltaNet path on `device_type` ("cpu" / "cuda"): fla, where it is
    installed and the device is CUDA; its torch rule otherwise (the bench tools' peer binding)."""
    import importlib.util

    return device_type == "cuda" and importlib.util.find_spec("fla") is not None


def _bindings(module, fn_name: str = "torch_chunk_gated_delta_rule") -> tuple:
    """(what the module's kernel wrapper `fn_name` forwards to, transformers' own torch function)."""
    fn = getattr(module, fn_name)
    try:
        found = inspect.getclosurevars(fn).nonlocals
        return found["implementation"], found["torch_function"]
    except (KeyError, TypeError) as e:
        raise RuntimeError(f"cannot tell which rule {module.__name__}.{fn_name} bound ({fn!r}): transformers' kernel "
                           "fallback has changed; update longstraw_mcore/bench/hf_kernels.py") from e


def torch_rule(module):
    """transformers' own torch chunked rule, whatever `module` bound (the kernel comparison of the bench)."""
    return _bindings(module)[1]


def gdn_path(module, fn_name: str = "torch_chunk_gated_delta_rule") -> str:
    """"fla" or "torch": the rule `module` (modeling_qwen3_5; or another, through its wrapper `fn_name`) bound at
    its import. (modeling_qwen3_5's `torch_chunk_gated_delta_rule` is the wrapper that forwards to what was
    bound, despite its name.)"""
    bound, own = _bindings(module, fn_name)
    if bound is own:
        return "torch"
    if (getattr(bound, "__module__", "") or "").startswith("fla."):
        return "fla"
    raise RuntimeError(f"{module.__name__} bound an unknown rule for {fn_name}: {bound!r}")


def _import(name: str, fla: bool):
    """Import `name` (first time: with `fla` unimportable unless fla=True)."""
    if name in sys.modules or fla:
        return importlib.import_module(name)
    saved = sys.modules.get("fla", ...)
    sys.modules["fla"] = None  # `import fla` raises ModuleNotFoundError inside transformers' fallback
    try:
        return importlib.import_module(name)
    finally:
        if saved is ...:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved


def _bound(name: str, wrappers: tuple[str, ...], what: str, fla: bool):
    """Module `name` imported (`_import`) with each of its kernel `wrappers` bound to fla or to torch as asked."""
    module = _import(name, fla)
    want = "fla" if fla else "torch"
    for fn_name in wrappers:
        got = gdn_path(module, fn_name)
        if got != want:
            raise RuntimeError(f"{name} was imported earlier with the {got} {what} rule ({fn_name}); this process "
                               f"needs the {want} rule (import it through longstraw_mcore.bench.hf_kernels first)")
    return module


def qwen3_5_modeling(fla: bool):
    """transformers' modeling_qwen3_5 with the requested rule bound (module docstring)."""
    return _bound(_MODULE, ("torch_chunk_gated_delta_rule",), "Gated DeltaNet", fla)


GLM5_NEXT = "transformers.models.glm5_next.modeling_glm5_next"
KDA_WRAPPERS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def glm5_next_modeling(fla: bool):
    """transformers' modeling_glm5_next (GLM-5.3-Flash) with its two Kimi Delta Attention rules, chunked and
    recurrent, bound to fla (fla=True) or to transformers' torch functions, as `qwen3_5_modeling`."""
    return _bound(GLM5_NEXT, KDA_WRAPPERS, "Kimi Delta Attention", fla)
