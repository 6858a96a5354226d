"""memory.recompute=layer and state staging around every decoder layer of a model, and the MLA query
block (config/memory.py).

`apply(model, mcfg)` wraps each local TransformerLayer's forward:

    staging      the layer's prompt state is put on the device for the call (memory/staging.py), found
                 through the call's prompt-state context (`inference_context.state.layers[n]`)
    recompute    under autograd the call runs in torch.utils.checkpoint (non-reentrant): the layer keeps
                 its inputs only, and its backward runs the call again (staging again), then its
                 backward on the recomputed tensors. The recompute repeats the call's reads of the
                 state; the kinds' recompute hooks hand out the same leaves on a second call
                 (prompt_state/gdn.py), so gradients reach the leaves the first call built, and keep
                 the first call's outputs as the sweep's roots (a recomputed one would hold its whole
                 recompute graph: measured, exact mode's peak grew by 0.54 MiB per layer). What a
                 mixer reads besides its arguments (`carried()`: a DSA shared layer's selection from
                 the previous full layer) is taken at the forward and restored for the recompute.

Under no_grad (capture, sampling) nothing is recomputed. The model records the section as
`model.memory` (replay/steps.py `new_state` reads it to place the state)."""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from longstraw_mcore.cpu_compat import redirect
from longstraw_mcore.memory.staging import staged


def layer_state(ctx, n: int):
    """The layer-`n` state kind a call's context carries, or None (no context, or no state for it)."""
    state = getattr(ctx, "state", None)
    layers = getattr(state, "layers", None)
    return None if layers is None else layers.get(n)


def _wrap(layer, core) -> None:
    # weak references: the wrapper lives on the layer, and a strong one to it (or to the model holding
    # it) would make a reference cycle that only the garbage collector frees
    inner, me, model = type(layer).forward, weakref.ref(layer), weakref.ref(core)
    n = layer.layer_number
    carries = hasattr(layer.self_attention, "carried")

    def run(carried, *args, **kwargs):
        layer = me()
        if carries:
            layer.self_attention.restore(carried)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        # (a recompute runs inside autograd's backward, where the CPU build's redirect is not active)
        with redirect(), staged(layer_state(kwargs.get("inference_context"), n), hidden.device):
            return inner(layer, *args, **kwargs)

    def forward(*args, **kwargs):
        carried = me().self_attention.carried() if carries else None
        if model().memory.recompute == "layer" and torch.is_grad_enabled():
            # early_stop=False: torch's early stop ends the recompute at the last tensor it needs, but
            # keeps what it recomputed until the whole backward ends (measured on the tiny hybrid: a
            # branch's backward peak grew by 0.73 MiB per layer, 6.2 MiB at 8 layers; 2.0 MiB without it)
            return checkpoint(run, carried, *args, use_reentrant=False, early_stop=False, **kwargs)
        return run(carried, *args, **kwargs)

    layer.forward = forward
    layer.memory_wrapped = True


def apply(model, mcfg) -> None:
    """Install the switches of `mcfg` (a MemoryConfig) on `model` (this rank's stage, or its DDP wrapper);
    again with another section to change them (the wrappers read `model.memory` at every call)."""
    core = getattr(model, "module", model)
    core.memory = mcfg
    for layer in core.decoder.layers:
        if not getattr(layer, "memory_wrapped", False):
            _wrap(layer, core)
        mixer = layer.self_attention
        if hasattr(mixer, "query_block"):
            mixer.query_block = mcfg.mla_query_block
