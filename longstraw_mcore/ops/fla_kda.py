"""Kimi Delta Attention through flash-linear-attention's Triton kernels (fla-core >= 0.6.0), behind the contract
of the plain twin in ops/kda.py:

    chunk_kda(q, k, v, g, beta, initial_state, chunk_size, state_dtype)
        q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H], an initial state [B,H,K,V] -> (o [B,T,H,V] in v's
        dtype, final state [B,H,K,V] in `state_dtype`); gradients to q, k, v, g, beta and the initial state

What the adapter does around fla's `chunk_kda`: the L2 norms of q and k run inside the kernel
(`use_qk_l2norm_in_kernel`) and q is scaled by K^-0.5, as the twin does; q, k and beta run in the values'
dtype, g and the states in float32 (fla wants a float32 initial state; its backward returns that state's
gradient, and a gradient reaching the final state enters as fla's `dht`: exact mode's prompt sweep and
replay need both). fla's chunk is FLA_CHUNK = 64 tokens whatever the twin's `chunk_size` (the same rule,
other rounding; a sequence that is not a whole number of chunks is masked inside fla, not cut in two).

The gate comes precomputed: g is the log decay `ops/kda.kda_gate` made (the mixer applies A_log, dt_bias and
the bound), exactly the twin's input, so the two are interchangeable everywhere the twin runs (the layer,
prompt capture, the sequence-parallel piece maps of ops/gdn_pieces.py, whose values are K + V wide).
fla can also make g itself (`use_gate_in_kernel` with A_log and dt_bias): that fuses the gate with the
chunk cumsum and keeps only the raw gate projection for the backward (2 bytes per channel and token in bf16)
where this path keeps about 16 (kda_gate's float32 argument and sigmoid, g itself and fla's cumsum of it):
at GLM-5.3-Flash's 64 heads x 128 that is ~128 KiB against ~16 KiB per token and KDA layer (without
recompute), and one elementwise kernel less each way. It changes the rule's contract (f, A_log, dt_bias in
place of g: a twin of its own), so it is left for later.

`lower_bound` (keyword only; ops/dispatch.kda_kernel binds it): the caller's promise that g >= lower_bound,
true of `kda_gate` with a bound. With one in [-5, 0) fla runs its bounded-gate path (`safe_gate`: the
intra-chunk diagonal blocks as tensor-core products of factored decays: what the checkpoints'
`linear_attn_config` names with `safe_gate` and `gate_lower_bound`); without one, or outside that range, the
general path (pairwise decays, any g <= 0: what transformers' glm5_next binding calls).
Both are held to the twin. (With a precomputed g fla reads `lower_bound` nowhere else.)

Where it runs (`missing`): CUDA tensors in bf16 / fp16 / fp32, or fp16 / fp32 CPU tensors under Triton's
interpreter (ops/triton_interpret.py; tests/fla_kda_checks.py holds every use to the twin there); never
float64 (fla has no float64 kernels); key dims up to 256 (fla's limit). fla's Hopper refusal of issue #640
does not apply: it sits in `chunk_bwd_dqkwg`, the Gated DeltaNet backward kernel, which KDA's backward does
not call (it runs its own `chunk_kda_bwd_wy_dqkg_fused`); the GPU check (tests/gpu/test_fla_kda.py)
compares the CUDA backward with the twin before any figure counts. Under the interpreter two more gaps are
bridged for the bounded-gate path (`_interpreter_bridges`); nothing in fla's kernels is changed.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
from types import SimpleNamespace

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLA_CHUNK = 64
MAX_KEY_DIM = 256
"""fla 0.6.0's chunk_kda asserts K <= 256."""
MIN_FLA = (0, 6, 0)
"""The fla-core this adapter was written and checked against (its chunk_kda keywords and 64-bit offsets)."""
SAFE_LOWER_BOUND = -5.0
"""fla's bounded-gate path keeps its factored decays inside float32 for bounds in [-5, 0)."""


@functools.cache
def _fla_version() -> tuple[int, ...] | None:
    """fla's version from its distribution (fla-core, or the older single package), else from the module."""
    text = None
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            text = md.version(dist)
            break
        except md.PackageNotFoundError:
            continue
    if text is None:
        import fla

        text = getattr(fla, "__version__", "0")
    return tuple(int(x) for x in text.split("+")[0].split(".")[:3] if x.isdigit())


def missing(x: torch.Tensor, key_dim: int | None = None) -> str | None:
    """Why fla's KDA cannot run on values `x` (keys of `key_dim`, default the values' head dim) here, or None."""
    from longstraw_mcore.ops import triton_interpret

    if x.dtype not in DTYPES:
        return f"values are {x.dtype} (fla runs bf16 / fp16 / fp32)"
    K = x.shape[-1] if key_dim is None else key_dim
    if K > MAX_KEY_DIM:
        return f"key dim {K} > {MAX_KEY_DIM} (fla's KDA kernels take key dims up to {MAX_KEY_DIM})"
    gap = triton_interpret.tensor_gap(x, "values")
    if gap is not None:
        return gap
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (fla-core) is not installed"
    have = _fla_version()
    if have < MIN_FLA:
        return (f"fla-core {'.'.join(map(str, have))} is too old for its KDA kernels here "
                f"(needs >= {'.'.join(map(str, MIN_FLA))})")
    return None


@functools.cache
def _fla():
    """fla's chunk_kda, imported once (after the interpreter's bridges where it interprets)."""
    from longstraw_mcore.ops import triton_interpret

    triton_interpret.install()
    from fla.ops.kda import chunk_kda

    _interpreter_bridges()
    return chunk_kda


def _interpreter_bridges() -> None:
    """Under Triton's interpreter only, two gaps of fla's bounded-gate kernels (fla/ops/kda/chunk_intra.py):
    1. `gather` there is a module-level alias of the builtin `tl.gather`; the interpreter patches the builtins
       on `triton.language` while a kernel runs, so the alias stays unpatched ("Did you forget to add
       @triton.jit ?"). Bridged: a function that looks `tl.gather` up when called.
    2. `SAFE_GATE_DOT_PRECISION` is "bf16x3" (a GPU rounding of float32 products, Triton >= 3.6); the
       interpreter's `tl.dot` takes tf32 / tf32x3 / ieee. Bridged: "ieee" (the interpreter multiplies in
       numpy float32 whatever it is told)."""
    from longstraw_mcore.ops import triton_interpret

    if not triton_interpret.active():
        return
    import triton.language as tl
    from fla.ops.kda import chunk_intra

    def gather(src, index, axis):
        return tl.gather(src, index, axis)

    chunk_intra.gather = gather
    chunk_intra.SAFE_GATE_DOT_PRECISION = tl.constexpr("ieee")


def chunk_kda(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, state_dtype=torch.float32, *,
              lower_bound: float | None = None):
    """fla's KDA behind the twin's contract (ops/kda.chunk_kda); `chunk_size` is the twin's and is not used
    (fla's chunk is FLA_CHUNK). `lower_bound`: module docstring (g >= lower_bound; [-5, 0) takes fla's
    bounded-gate path)."""
    if not (q.shape == k.shape == g.shape and v.shape[:3] == q.shape[:3] and beta.shape == q.shape[:3]):
        raise ValueError(f"KDA shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)} must be equal "
                         f"[B,T,H,K]; v {tuple(v.shape)} [B,T,H,V]; beta {tuple(beta.shape)} [B,T,H]")
    B, T, H, K = q.shape
    if T == 0:  # (an empty sequence-parallel piece; the twin returns the state it was given)
        state = initial_state if initial_state is not None else v.new_zeros(B, H, K, v.shape[-1])
        return v.new_zeros(B, 0, H, v.shape[-1]), state.to(state_dtype)
    rule = _fla()
    dt = v.dtype
    h0 = None if initial_state is None else initial_state.float()
    safe = lower_bound is not None and SAFE_LOWER_BOUND <= lower_bound < 0
    o, final = rule(q.to(dt), k.to(dt), v, g.float(), beta.to(dt), scale=K ** -0.5, initial_state=h0,
                    output_final_state=True, use_qk_l2norm_in_kernel=True, safe_gate=safe,
                    lower_bound=lower_bound if safe else None, chunk_size=FLA_CHUNK)
    return o.to(dt), final.to(state_dtype)


@functools.cache
def bounded(lower_bound: float) -> SimpleNamespace:
    """`chunk_kda` with `lower_bound` bound (ops/dispatch.kda_kernel's answer for a bounded gate): a namespace
    whose `chunk_kda` has the twin's contract."""
    return SimpleNamespace(chunk_kda=functools.partial(chunk_kda, lower_bound=lower_bound), lower_bound=lower_bound)
