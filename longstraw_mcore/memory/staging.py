"""A layer's prompt state between its runs: in host memory (memory.state_offload) and/or as fp8 blocks
(memory.state_dtype=fp8); while the layer runs, a working copy in the model dtype on the device.

A state kind names its position-sized tensors in `staged` (attention K/V, MLA latents and index keys;
Gated DeltaNet's state is the same size at any prompt length and stays where it is). `place` gives
each such tensor a home:

    offload, model dtype   a host tensor (pinned when the model is on CUDA); outside a run the kind's
                           attribute is that host tensor, so exact mode's gradient accumulators and
                           leaves, made from it, are host tensors too
    fp8 (device or host)   an Fp8Rows store; outside a run the attribute is None. A kind's
                           `exact_rows` stay in the model dtype: DSA's index keys decide the discrete
                           top-k, and rounding them flips selections (measured on the tiny GLM with
                           fp8 index keys: gradient cosine 0.887 against the bf16 state; 0.9999 without)

`staged(layer_state, device)` (the layer's run, memory/layers.py) puts a working copy on the device in
the attribute (dequantized from fp8), runs the layer, writes back the rows a capture chunk appended
(the kind's `length` before and after: rows are along dim 1), and restores the home. A replay or
recompute changes no row, so nothing is written back. Results are bit-identical to the resident state
with model-dtype homes (a copy is exact); fp8 rounds each row once, when it is written.

On CUDA the copies are non-blocking from pinned memory; prefetching the next layer on a side stream
is not built (the copy is on the layer's critical path; planner/memory.py counts the transfer time)."""

from __future__ import annotations

import contextlib

import torch

from longstraw_mcore.memory.fp8 import Fp8Rows


def _home(t: torch.Tensor, fp8: bool, host: bool, device, pin: bool):
    where = "cpu" if host else device
    if fp8:
        return Fp8Rows(t.shape, t.dtype, where, pin=pin and host)
    return torch.zeros(t.shape, dtype=t.dtype, device=where, pin_memory=pin and host)


def place(state, mcfg, device) -> None:
    """Give the staged tensors of every layer of `state` (allocated on the meta device) their home, and
    the kinds' other meta tensors (bookkeeping) real storage on `device`."""
    device = torch.device(device)
    pin = device.type == "cuda"
    fp8 = mcfg.state_dtype == "fp8"
    for st in state.layers.values():
        cats = {id(t): cat for cat, ts in st.kept().items() for t in ts if t is not None}
        st.home, st.host = {}, mcfg.state_offload
        for name, t in list(vars(st).items()):
            if not (isinstance(t, torch.Tensor) and t.is_meta):
                continue
            if name in st.staged:
                store = _home(t, fp8 and name not in st.exact_rows, mcfg.state_offload, device, pin)
                st.home[name] = (cats.get(id(t), name), store)
                setattr(st, name, None if fp8 else store)
            else:
                setattr(st, name, torch.zeros(t.shape, dtype=t.dtype, device=device))


def home_tensors(st) -> dict[str, list[torch.Tensor]]:
    """Byte category -> the storages of a layer's homes (empty when its state is resident)."""
    out: dict[str, list[torch.Tensor]] = {}
    for cat, store in (st.home or {}).values():
        out.setdefault(cat, []).extend(store.tensors() if isinstance(store, Fp8Rows) else [store])
    return out


@contextlib.contextmanager
def staged(st, device):
    """The layer state `st` on `device` for the duration of its layer's run (no-op when resident)."""
    if st is None or not st.home:
        yield
        return
    before = st.length
    for name, (_, store) in st.home.items():
        if isinstance(store, Fp8Rows):
            setattr(st, name, store.dequantize(device))
        else:
            setattr(st, name, torch.empty(store.shape, dtype=store.dtype, device=device).copy_(store,
                                                                                            non_blocking=True))
    try:
        yield
    finally:
        after = st.length
        for name, (_, store) in st.home.items():
            work = getattr(st, name)
            if after > before:  # a capture chunk appended rows [before, after)
                if isinstance(store, Fp8Rows):
                    store.write(before, work[:, before:after])
                else:
                    store[:, before:after].copy_(work[:, before:after], non_blocking=True)
            setattr(st, name, None if isinstance(store, Fp8Rows) else store)
