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
    gdn         Gated DeltaNet's rule and causal conv. auto: flash-linear-attention's Triton kernels
                (ops/fla_gdn.py) for CUDA bf16 / fp16 / fp32 values where fla is installed (the `gpu`
                extra; on Hopper with Triton < 3.7.1 only for key dims > 64), the plain twins
                (ops/gated_delta.py) otherwise; plain: the twins; fla: fla, and an error naming the
                reason where it cannot run. On CPU, fla runs only forced and under Triton's
                interpreter (ops/triton_interpret.py: the tests that hold it to the twins). The same
                choice runs Kimi Delta Attention's rule (GLM-5.3-Flash; `kda_kernel`: ops/fla_kda.py or
                the twin ops/kda.py; key dims <= 256, no Hopper gate) and its conv (`conv_kernel`)
    dsa         GLM's DSA indexer top-k and sparse MLA attention. auto: the project's Triton kernels
                (ops/dsa_triton_indexer.py, ops/dsa_triton_mla.py) for CUDA bf16 / fp16 / fp32, the
                plain twins (ops/dsa.py) otherwise; plain: the twins; triton: the kernels, and an error
                naming the reason where they cannot run (on CPU: only under Triton's interpreter)

`override(attention="plain")` switches for a block (tests, benchmarks comparing kernels).
`kernels_run()` counts the calls each op made to each kernel in this process since `reset_kernels()`
(`longstraw validate` puts them in its receipt as `kernels`).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from longstraw_mcore.config import OpsConfig
from longstraw_mcore.ops import (block_attention, dsa, fla_gdn, fla_kda, flash_attention, gated_delta, kda,
                                 triton_interpret)
from longstraw_mcore.ops.kernel_choice import DSA_DTYPES, attention_kernel_name

_choice = OpsConfig()
_runs: dict[str, dict[str, int]] = {}


def _record(op: str, kernel: str) -> None:
    per = _runs.setdefault(op, {})
    per[kernel] = per.get(kernel, 0) + 1


def reset_kernels() -> None:
    _runs.clear()


def kernels_run() -> dict[str, dict[str, int]]:
    """{op: {kernel: calls}} since the last `reset_kernels()`: attention {flash | plain},
    gdn_rule, gdn_conv and kda_rule {fla | plain}, dsa_indexer and dsa_attention {triton | plain}."""
    return {op: dict(per) for op, per in sorted(_runs.items())}


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
    _record("attention", "flash" if ok else "plain")
    return flash_attention if ok else block_attention


def _why_not(choice: str, option: str, x, missing) -> str | None:
    """Why `option`'s kernels do not run for tensors like `x` under the choice (auto / plain / the kernels'
    name), or None: plain refuses, auto takes them on CUDA only (decided before `missing()`, which imports
    triton), otherwise `missing()` says."""
    if choice == "plain":
        return f"{option}=plain"
    if choice == "auto" and x.device.type != "cuda":
        return "auto takes the kernels on CUDA only"
    return missing()


def _gdn(op: str, x, key_dim: int | None):
    c = _choice.gdn
    why = _why_not(c, "ops.gdn", x, lambda: fla_gdn.missing(x, key_dim))
    if c == "fla" and why is not None:
        raise ValueError(f"ops.gdn=fla cannot run here: {why} (use ops.gdn=auto or plain)")
    _record(op, "plain" if why else "fla")
    return gated_delta if why else fla_gdn


def gdn_kernel(v, key_dim: int):
    """The module whose `chunk_gated_delta_rule` runs for values `v` and keys of `key_dim`."""
    return _gdn("gdn_rule", v, key_dim)


def kda_kernel(v, key_dim: int | None = None, lower_bound: float | None = None):
    """What runs Kimi Delta Attention's `chunk_kda` (the twin's contract) for values `v` and keys of `key_dim`
    (default v's head dim: KDA's K = V in GLM-5.3-Flash), by the `ops.gdn` choice (the KDA layer's conv is
    `conv_kernel`'s already): fla's kernels (ops/fla_kda.py) or the plain twin (ops/kda.py), recorded as
    op "kda_rule". `lower_bound`: the gate's bound when g comes from `kda_gate` with one; fla then gets it
    bound (`fla_kda.bounded`: its bounded-gate path for bounds in [-5, 0)); the twin needs none."""
    c = _choice.gdn
    why = _why_not(c, "ops.gdn", v, lambda: fla_kda.missing(v, key_dim))
    if c == "fla" and why is not None:
        raise ValueError(f"ops.gdn=fla cannot run Kimi Delta Attention here: {why} (use ops.gdn=auto or plain)")
    _record("kda_rule", "plain" if why else "fla")
    if why:
        return kda
    return fla_kda if lower_bound is None else fla_kda.bounded(float(lower_bound))


def conv_kernel(x):
    """The module whose `causal_conv1d` runs Gated DeltaNet's conv over inputs `x`."""
    return _gdn("gdn_conv", x, None)


def _dsa_missing(x) -> str | None:
    """Why the DSA kernels cannot run on tensors like `x` here, or None."""
    if str(x.dtype).removeprefix("torch.") not in DSA_DTYPES:
        return f"tensors are {x.dtype} (the kernels run fp32 / bf16 / fp16; float64 runs the twin)"
    return triton_interpret.tensor_gap(x)


def dsa_kernel(x, op: str):
    """The module whose `indexer_topk` (op "dsa_indexer") or `mla_sparse` / `mla_sparse_partial` (op
    "dsa_attention") runs for tensors like `x` (the queries)."""
    c = _choice.dsa
    why = _why_not(c, "ops.dsa", x, lambda: _dsa_missing(x))
    if c == "triton" and why is not None:
        raise ValueError(f"ops.dsa=triton cannot run here: {why} (use ops.dsa=auto or plain)")
    _record(op, "plain" if why else "triton")
    if why:
        return dsa
    triton_interpret.install()
    if op == "dsa_indexer":
        from longstraw_mcore.ops import dsa_triton_indexer as mod
    else:
        from longstraw_mcore.ops import dsa_triton_mla as mod
    return mod
