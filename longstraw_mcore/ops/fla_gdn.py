"""Gated DeltaNet through flash-linear-attention's Triton kernels (fla-core 0.6.0), behind the contracts of
the plain twins in ops/gated_delta.py:

    chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size, state_dtype)
        q, k [B,T,h,K] (h key heads), v [B,T,H,V] (H = r h), g (log decay) / beta [B,T,H], an initial state
        [B,H,K,V] -> (o [B,T,H,V] in v's dtype, final state [B,H,K,V] in `state_dtype`)
    causal_conv1d(x, weight, conv_state, activation) -> (y [B,T,Ch], state [B,Ch,W-1])

What the adapter does around fla: value head j reads key head j // r (fla's grouped values, the twin's
repeated key heads: no copy); the L2 norms of q and k run inside the kernel and q is scaled by K^-0.5, as
the twin does; g and the states are float32 (fla keeps its state in float32; the initial state's
gradient comes back from fla's backward, and a gradient reaching the final state enters it as fla's
`dht`: exact mode's prompt sweep needs both). fla's chunk is 64 tokens whatever the twin's
`gdn_chunk_size` (the same rule; rounding differs). fla's conv keeps a window of W inputs where the twin
keeps W - 1: the oldest is padded in with zeros (the kernel never reads it) and dropped from the state
it returns.

Where it runs (`missing`): CUDA tensors in bf16 / fp16 / fp32, or fp16 / fp32 CPU tensors under Triton's
interpreter (ops/triton_interpret.py: the CI tests hold every use to the twin there); never float64 (fla
has no float64 kernels). On Hopper with Triton 3.4-3.7.0, fla refuses its gated backward (fla issue #640: a
Triton miscompile at key block 64 that corrupts dk, dg and dbeta); fla 0.6.0 runs key block 128 on Hopper
whenever K > 64 (Qwen3.6's K is 128), outside the miscompile, so for K > 64 the refusal is lifted for
that call alone (`_hopper_gate`) and K <= 64 is refused here with the reason. The GPU check compares the
CUDA backward with the twin before any figure counts.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLA_CHUNK = 64
GATE_MAX_SAFE_K = 64
"""fla issue #640 corrupts the gated backward at key block 64; fla 0.6.0 uses block 128 on Hopper for K > 64."""


def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3] if x.isdigit())


def _hopper_gate_applies(device: torch.device) -> bool:
    """fla's #640 refusal applies: a Hopper GPU (compute capability 9.x) with Triton in [3.4.0, 3.7.1)."""
    return device.type == "cuda" and _hopper_gate_on(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _hopper_gate_on(index: int) -> bool:
    """(`_hopper_gate_applies` for CUDA device `index`, asked once per device: it is on every call's path.)"""
    return torch.cuda.get_device_capability(index)[0] == 9 and (3, 4, 0) <= _triton_version() < (3, 7, 1)


def missing(v: torch.Tensor, key_dim: int | None = None) -> str | None:
    """Why fla cannot run the rule (or the conv, `key_dim` None) on values `v` here, or None."""
    from longstraw_mcore.ops import triton_interpret

    if v.dtype not in DTYPES:
        return f"values are {v.dtype} (fla runs bf16 / fp16 / fp32)"
    gap = triton_interpret.tensor_gap(v, "values")
    if gap is not None:
        return gap
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (fla-core) is not installed"
    if key_dim is not None and key_dim <= GATE_MAX_SAFE_K and _hopper_gate_applies(v.device):
        import triton

        return (f"key dim {key_dim} <= {GATE_MAX_SAFE_K} on Hopper with triton {triton.__version__}: fla's gated "
                "backward is miscompiled there (fla issue #640; triton >= 3.7.1 fixes it)")
    return None


def prepare() -> None:
    """Import fla once as this module runs it: the interpreter's bridges where it interprets, and the Hopper
    gate lifted for key dims > 64 (`_hopper_gate`), for every caller of fla's rule in this process (the
    benchmark's transformers peer too, which would otherwise be refused its backward on Hopper)."""
    _fla()


@functools.cache
def _fla():
    """fla's two entry points, imported once (after the interpreter's bridges where it interprets)."""
    from longstraw_mcore.ops import triton_interpret

    triton_interpret.install()
    from fla.modules.causal_conv1d import causal_conv1d as conv
    from fla.ops.gated_delta_rule import chunk as gdn_chunk

    _hopper_gate(gdn_chunk)
    return gdn_chunk.chunk_gated_delta_rule, conv


def _hopper_gate(gdn_chunk) -> None:
    """Lift fla's #640 refusal in the gated delta rule's backward for calls with K > 64 only (module
    docstring): fla's rule calls `chunk_bwd_dqkwg` by the name it imported, which is wrapped here."""
    from fla.ops.common import chunk_o

    inner = gdn_chunk.chunk_bwd_dqkwg

    @functools.wraps(inner)
    def guarded(*args, **kwargs):
        k = kwargs["k"] if "k" in kwargs else args[1]
        if not _hopper_gate_applies(k.device) or chunk_o.TRITON_ABOVE_3_7_1:
            return inner(*args, **kwargs)
        if k.shape[-1] <= GATE_MAX_SAFE_K:
            raise RuntimeError(f"fla's gated backward at key dim {k.shape[-1]} is miscompiled on Hopper with this "
                               "triton (fla issue #640)")
        chunk_o.TRITON_ABOVE_3_7_1 = True
        try:
            return inner(*args, **kwargs)
        finally:
            chunk_o.TRITON_ABOVE_3_7_1 = False

    gdn_chunk.chunk_bwd_dqkwg = guarded


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = 64,
                           state_dtype=torch.float32):
    """fla's rule behind the twin's contract (ops/gated_delta.chunk_gated_delta_rule); `chunk_size` is the
    twin's and is not used (fla's chunk is FLA_CHUNK: the same rule, other rounding)."""
    rule, _ = _fla()
    dt = v.dtype
    h0 = None if initial_state is None else initial_state.float()
    o, final = rule(q.to(dt), k.to(dt), v, g.float(), beta.to(dt), scale=q.shape[-1] ** -0.5, initial_state=h0,
                    output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=FLA_CHUNK)
    return o.to(dt), final.to(state_dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
                  activation: str | None = None):
    """fla's Triton conv behind the twin's contract (ops/gated_delta.causal_conv1d)."""
    B, T, Ch = x.shape
    W = weight.shape[-1]
    if T == 0:  # (an empty sequence-parallel piece; the twin returns the window it was given)
        state = conv_state if conv_state is not None else x.new_zeros(B, Ch, W - 1)
        return x.new_zeros(B, 0, Ch), state.to(x.dtype)
    _, conv = _fla()
    init = None if conv_state is None else torch.cat([conv_state.new_zeros(B, Ch, 1), conv_state], -1).to(x.dtype)
    y, final = conv(x, weight.to(x.dtype), initial_state=init, output_final_state=True, activation=activation)
    return y, final[..., 1:]
