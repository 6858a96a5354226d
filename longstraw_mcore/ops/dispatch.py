"""Which kernel an op runs. One function per op picks it from the tensors' device and dtype and the
run's choice (`ops.*` in a run config, applied by `configure`):

    attention   auto: flash (ops/flash_attention.py, torch's flash ops) for CUDA bf16 / fp16 with head
                dim <= 256, the plain-torch twin (ops/block_attention.py) otherwise (CPU, float32,
                float64: always the twin); plain: the twin everywhere; flash: flash, and an error where
                it cannot run (comparisons must not silently measure the twin)
    gdn         plain only so far (flash-linear-attention is the GPU issue's next step)

`override(attention="plain")` switches for a block (tests, benchmarks comparing kernels).
"""

from __future__ import annotations

from contextlib import contextmanager

from longstraw_mcore.config import ConfigError

ATTENTION = ("auto", "plain", "flash")
GDN = ("auto", "plain")
_choice = {"attention": "auto", "gdn": "auto"}


def _check(name: str, value: str) -> None:
    valid = {"attention": ATTENTION, "gdn": GDN}[name]
    if value not in valid:
        raise ConfigError(f"ops.{name}={value!r}: must be one of {', '.join(valid)}")


def configure(ops) -> None:
    """Apply a run config's `ops` section (an OpsConfig) for this process."""
    for name in ("attention", "gdn"):
        _check(name, getattr(ops, name))
        _choice[name] = getattr(ops, name)


@contextmanager
def override(**choices):
    before = dict(_choice)
    for name, value in choices.items():
        _check(name, value)
    _choice.update(choices)
    try:
        yield
    finally:
        _choice.clear()
        _choice.update(before)


def attention_kernel(q):
    """The partial kernels (partial_forward / partial_backward) for queries `q`."""
    from longstraw_mcore.ops import block_attention, flash_attention

    c = _choice["attention"]
    if c == "plain":
        return block_attention
    ok = flash_attention.supports(q) and flash_attention.available()
    if c == "flash" and not ok:
        raise ValueError(f"ops.attention=flash needs CUDA bf16/fp16 queries with head dim <= 256 and torch's flash "
                         f"op; got {q.device.type} {q.dtype}, head dim {q.shape[-1]} (use ops.attention=auto)")
    return flash_attention if ok else block_attention
