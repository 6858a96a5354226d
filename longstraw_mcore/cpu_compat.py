"""Make Megatron-Core 0.19 run on CPU with gloo.

Megatron-Core assumes CUDA at a handful of call sites. `enable()` patches exactly those, once per
process (idempotent), and only when the run is configured for `device == "cpu"`; on CUDA nothing
here is touched. Each patch names the Megatron call site it serves and has a test in
tests/unit/test_cpu_compat.py (single process) or tests/dist/ (multi-rank).

The CPU conventions for `TransformerConfig` (fusions off, CPU initialisation, no p2p sync) live
in `cpu_config_overrides()` so no other module has to know them.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

from longstraw_mcore import lazy_compile

_LOCK = threading.Lock()
_ENABLED = False
_MODE: "_CudaToCpuMode | None" = None


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # Integer ordinals mean "CUDA device n" to torch's factory functions.
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect hard-coded CUDA placements to the CPU.

    Serves ~25 call sites in Megatron-Core 0.19.2 that allocate with `device="cuda"` or
    `torch.cuda.current_device()` (e.g. pipeline_parallel/schedules.py:749 `total_num_tokens`,
    transformer/utils.py:39 causal mask, tensor_parallel/mappings.py:185 SP buffers,
    models/common/embeddings/rope_utils.py:62 `.cuda(non_blocking=True)`), and drops
    `pin_memory=True` (needs a CUDA driver). `Tensor.type()` reports `torch.cuda.*` for CPU float
    tensors: optimizer/distrib_optimizer.py:401 and optimizer/clip_grads.py:174 assert it.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Hot path (every torch call in the process): no allocation unless something must change.
        if kwargs:
            dev = kwargs.get("device")
            if (dev is not None and _is_cuda_device(dev)) or kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                if dev is not None and _is_cuda_device(dev):
                    kwargs["device"] = torch.device("cpu")
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
        else:
            kwargs = {}
        special = _SPECIAL.get(func)
        if special is None:
            return func(*args, **kwargs)
        if special == "identity":  # Tensor.cuda(...), Tensor.pin_memory(): stay on CPU
            return args[0]
        if special == "to":
            args = tuple(torch.device("cpu") if (i > 0 and _is_cuda_device(a) and not isinstance(a, int)) else a
                         for i, a in enumerate(args))
            return func(*args, **kwargs)
        # Tensor.type() with no arguments
        out = func(*args, **kwargs)
        if len(args) == 1 and not kwargs and isinstance(out, str) and out.startswith("torch.") and ".cuda." not in out:
            return out.replace("torch.", "torch.cuda.", 1)
        return out


_SPECIAL = {torch.Tensor.cuda: "identity", torch.Tensor.pin_memory: "identity", torch.Tensor.to: "to",
            torch.Tensor.type: "type"}


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: moe/token_dispatcher.py:469 builds a Stream at
    construction; dist_checkpointing and DDP record/wait events."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NoOpStream()

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cpu_rng_tracker_patches() -> None:
    """tensor_parallel/random.py:303: `CudaRNGStatesTracker.add` reads `torch.cuda.get_rng_state()`.
    On CPU the model-parallel RNG states live on the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(*a, **k):
        return torch.get_rng_state()

    def _set_state(new_state, *a, **k):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state
    torch.cuda.get_rng_state = _get_state
    torch.cuda.set_rng_state = _set_state
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None


def _moe_split_sizes_patch() -> None:
    """transformer/moe/moe_utils.py:1184 `maybe_move_tensor_to_cpu` converts all-to-all split sizes
    to a list only `if tensor.is_cuda`; gloo's all_to_all_single needs lists."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if tensor is None:
            return None
        if isinstance(tensor, torch.Tensor):
            return tensor.numpy() if as_numpy else tensor
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _new_empty_patch() -> None:
    """tensor_parallel/mappings.py:444 `_AllToAll` (the expert-parallel dispatch, forward and, through
    its backward, the gradient) allocates with `new_empty(..., device=torch.cuda.current_device())`.
    The redirect mode cannot reach the backward: autograd runs Python Functions' backward with torch
    function modes off (measured on torch 2.11), so `Tensor.new_empty` itself maps CUDA to CPU."""
    orig = torch.Tensor.new_empty

    def new_empty(self, *size, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs["device"] = torch.device("cpu")
        return orig(self, *size, **kwargs)

    torch.Tensor.new_empty = new_empty


def _function_backward_patch() -> None:
    """Sequence parallelism (the MoE layer's token split and gather at tp > 1) runs backwards of
    Megatron's autograd Functions that allocate their all-gather / reduce-scatter buffers with
    `torch.empty(..., device=torch.cuda.current_device())` (tensor_parallel/mappings.py:152,
    tensor_parallel/layers.py:646), where the redirect mode is off (autograd runs Python backwards
    with torch function modes disabled): every Function of those two modules runs its backward with
    the redirect mode entered."""
    from megatron.core.tensor_parallel import layers, mappings

    for module in (mappings, layers):
        for obj in list(vars(module).values()):
            if not (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)) or "backward" not in vars(obj):
                continue
            orig = obj.backward

            @functools.wraps(orig)
            def backward(ctx, *grads, _orig=orig):
                with _CudaToCpuMode():
                    return _orig(ctx, *grads)

            obj.backward = staticmethod(backward)


def enable(device: str) -> bool:
    """Apply the CPU patches if `device == "cpu"`; return whether they are active.

    Idempotent and thread-safe; call before building any Megatron module."""
    global _ENABLED, _MODE
    if device != "cpu":
        return False
    with _LOCK:
        if _ENABLED:
            return True
        # torch.cuda.current_device(): models/common/embeddings/rotary_pos_embedding.py:160 moves
        # inv_freq to it, megatron_fsdp.py:234 formats f"cuda:{n}" from it -> keep an int; the
        # redirect mode maps int ordinals to CPU.
        torch.cuda.current_device = lambda: 0
        # pipeline_parallel/p2p_communication.py:419, dist_checkpointing/strategies/
        # filesystem_async.py:248 and DDP call torch.cuda.synchronize / streams / events.
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Stream = _NoOpStream
        torch.cuda.Event = _NoOpStream
        torch.cuda.current_stream = lambda *a, **k: _NoOpStream()
        torch.cuda.default_stream = lambda *a, **k: _NoOpStream()
        torch.cuda.stream = lambda *a, **k: _NoOpStream()
        torch.cuda.empty_cache = lambda: None
        _cpu_rng_tracker_patches()
        _moe_split_sizes_patch()
        _new_empty_patch()
        _function_backward_patch()
        lazy_compile.run_eagerly()  # Megatron's torch.compile'd functions uncompiled (lazy_compile.py)
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()  # process-wide: the mode stays on the stack for the life of the process
        _ENABLED = True
    return True


def is_enabled() -> bool:
    return _ENABLED


def redirect():
    """The CUDA -> CPU redirect for code that runs where the process-wide mode is not on the stack:
    autograd's backward (as `_function_backward_patch` wraps Functions), e.g. a layer's recompute under
    torch.utils.checkpoint (memory/layers.py); a no-op context when the patches are off."""
    import contextlib

    return _CudaToCpuMode() if _ENABLED else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def cpu_config_overrides() -> dict:
    """TransformerConfig fields that must take these values on CPU (no fused CUDA kernels, CPU
    initialisation, gloo p2p without torch.cuda.synchronize)."""
    return dict(
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        batch_p2p_sync=False,
        moe_grouped_gemm=False,
    )
