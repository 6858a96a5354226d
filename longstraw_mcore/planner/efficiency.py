"""The time model's efficiencies (planner/timing.py): per phase, the fraction of the device's dense bf16
peak (planner/devices.py, the one home of peaks and bandwidths) a group step's work reaches, by device,
gradient mode and the kernels the run takes on CUDA.

Measured: one H200 lease (scripts/gpu_check.sh, bench_results/h200_gpu_check_20261204/, committed in
8917b2f on 2026-12-04; torch 2.11.0+cu130, triton 3.6.0): tools/bench_replay.py on the Qwen3.6-27B width
at 4 layers, bf16, R = 1,024, G = 2, chunk 4,096, attention on torch's CUDA flash ops and Gated
DeltaNet on the plain-torch chunked rule (flash-linear-attention did not run there: it needs triton
>= 3.7.1). A figure is the phase's algorithm FLOPs / its seconds / the H200's peak in DEVICE_PROFILES
(989e12, which the bench's fraction_of_peak used too, so an H200 plan reproduces the measured
seconds): detached mode from the P = 131,072 run, exact mode from the P = 32,768 run. They are single
runs: the earlier 4-layer bench (bench_results/h200_qwen27b_4layer_bench.json, P = 8K-131K, G = 2 and
8) spread 2.1-4.0% for the capture and 3.7-6.4% for the replay.

recompute (memory.recompute=layer) is forward work with no measurement of its own: it takes the
capture's figure (the capture is the measured phase that runs forward only).

Derived, for every other device X from the H200 row (a two-term roofline): of an H200 phase's time t at
efficiency e, the part e t is its FLOPs at the peak and scales with the peak; the rest, (1 - e) t, is
memory traffic and kernel overheads (at a few percent of the peak) and scales with HBM bandwidth:

    t_X = t_H200 (e F_H200 / F_X + (1 - e) B_H200 / B_X)
    e_X = 1 / (1 + (1/e - 1) (F_X / F_H200) (B_H200 / B_X))

(F the dense bf16 peak, B the HBM bandwidth). It never passes 1, so it needs no ceiling; for small e it
tends to the pure bandwidth rule e_X = e (F_H200 / F_X) (B_X / B_H200) and lies below it (11% on the
H20: the compute share slows with the peak). What the rest scales with is not measured: launch
overheads do not scale (the H20 faster than this), arithmetic off the tensor cores scales with the
CUDA-core rate (the H20's reported 44 fp32 TFLOP/s against the H200's 67: 1.5x where bandwidth says 1.2x).

Kernels: there is no measurement with flash-linear-attention yet, so a run that would take it
(`ops.gdn` auto on CUDA bf16 / fp16, or fla) is planned at the plain rule's figures and says so; the
same for the plain attention twin (flash figures), and for a model without Gated DeltaNet layers (the
hybrid's figures). These rows change when fla is measured on a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longstraw_mcore.config import ConfigError
from longstraw_mcore.planner.devices import DEVICE_PROFILES

MEASURED_DEVICE = "H200-141GB"
MEASURED_KERNELS = {"gdn": "plain", "attention": "flash"}
"""The kernels the H200 rows ran (bench_results/h200_gpu_check_20261204/README.md)."""
MEASURED_ON = (f"{MEASURED_DEVICE}, 2026-12-04 (committed in 8917b2f), Qwen3.6-27B width at 4 layers, bf16: "
               f"gdn {MEASURED_KERNELS['gdn']}, attention {MEASURED_KERNELS['attention']}")
DETACHED_128K = "bench_results/h200_gpu_check_20261204/bench_128k_detached.json"
EXACT_32K = "bench_results/h200_gpu_check_20261204/bench_32k_exact.json"
MODES = ("detached", "exact")
GDN_KERNELS = ("plain", "fla", "none")
"""ops.gdn's rule on CUDA (ops/kernel_choice.py gdn_kernel_name); "none": the model has no Gated DeltaNet."""
ATTENTION_KERNELS = ("flash", "plain")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One phase's figure on the H200: algorithm FLOPs / phase seconds / DEVICE_PROFILES' peak."""

    mode: str
    phase: str
    value: float
    file: str
    """Where the FLOPs and seconds are (its rows[0]: flops_algorithm, phase_seconds)."""


MEASURED = (
    Measurement(mode="detached", phase="capture", value=0.027720, file=DETACHED_128K),  # 306.94 TFLOP in 11.196 s
    Measurement(mode="detached", phase="replay", value=0.064261, file=DETACHED_128K),  # 61.497 TFLOP in 0.96764 s
    Measurement(mode="exact", phase="capture", value=0.032588, file=EXACT_32K),  # 76.733 TFLOP in 2.3808 s
    Measurement(mode="exact", phase="replay", value=0.046018, file=EXACT_32K),  # 50.778 TFLOP in 1.1157 s
    Measurement(mode="exact", phase="prompt_backward", value=0.036638, file=EXACT_32K),  # 312.81 TFLOP in 8.6328 s
)
"""tests/unit/test_efficiency_table.py recomputes each from its file."""


@dataclass(frozen=True, kw_only=True)
class Figure:
    value: float
    """Fraction of the device's dense bf16 peak."""
    source: str
    """"measured", "derived" or "override" (`longstraw plan --efficiency`)."""
    basis: str
    """The file it was measured in, or what it is derived from."""

    def as_json(self) -> dict:
        return {"value": self.value, "source": self.source, "from": self.basis}


@dataclass(frozen=True, kw_only=True)
class Efficiencies:
    """One row: a device and gradient mode on the measured kernels, a figure per time-model phase."""

    device: str
    mode: str
    capture: Figure
    replay: Figure
    recompute: Figure
    prompt_backward: Figure | None
    """Exact mode only."""
    measured_on: str = MEASURED_ON
    """The lease, model and kernels the figures come from ("" for --efficiency)."""
    notes: tuple[str, ...] = ()
    """Where the run's kernels are not the measured ones: which figures stand in."""

    def phases(self) -> dict[str, Figure]:
        out = {"capture": self.capture, "replay": self.replay, "recompute": self.recompute}
        return out | ({"prompt_backward": self.prompt_backward} if self.prompt_backward else {})


def derive(e: float, device: str) -> float:
    """The module docstring's rule: an H200 efficiency `e` on `device`."""
    h, x = DEVICE_PROFILES[MEASURED_DEVICE], DEVICE_PROFILES[device]
    return 1.0 / (1.0 + (1.0 / e - 1.0) * (x.bf16_flops / h.bf16_flops) * (h.hbm_bytes_per_s / x.hbm_bytes_per_s))


def _row(device: str, mode: str) -> Efficiencies:
    measured = {m.phase: Figure(value=m.value, source="measured", basis=m.file) for m in MEASURED if m.mode == mode}
    if device != MEASURED_DEVICE:
        measured = {k: Figure(value=derive(f.value, device), source="derived",
                              basis=f"{f.value:.2%} measured on {MEASURED_DEVICE} ({f.basis}) scaled by peak and "
                                    "HBM bandwidth (planner/efficiency.py)") for k, f in measured.items()}
    cap = measured["capture"]
    recompute = Figure(value=cap.value, source="derived", basis="the capture's figure (recompute is forward work)")
    return Efficiencies(device=device, mode=mode, capture=cap, replay=measured["replay"], recompute=recompute,
                        prompt_backward=measured.get("prompt_backward"))


TABLE = {(d, m): _row(d, m) for d in DEVICE_PROFILES for m in MODES}
"""{(device, mode): its row on the measured kernels}."""


def efficiencies(device: str, mode: str, gdn: str, attention: str) -> Efficiencies:
    """The row for `device` (a DEVICE_PROFILES name) in `mode` when the run takes Gated DeltaNet rule
    `gdn` and attention kernel `attention` on CUDA, with a note for each kernel that was not measured."""
    for name, value, valid in (("device", device, sorted(DEVICE_PROFILES)), ("mode", mode, MODES),
                               ("gdn kernel", gdn, GDN_KERNELS), ("attention kernel", attention, ATTENTION_KERNELS)):
        if value not in valid:
            raise ConfigError(f"efficiency table: {name} {value!r} is not known; known: {list(valid)}")
    notes = []
    if gdn == "fla":
        notes.append("no measurement with fla yet: plain-rule figures")
    elif gdn == "none":
        notes.append("no Gated DeltaNet layers: the Qwen3.6 hybrid's figures (measured with them)")
    if attention != MEASURED_KERNELS["attention"]:
        notes.append("no measurement with the plain attention twin: flash-attention figures")
    return dataclasses.replace(TABLE[(device, mode)], notes=tuple(notes))


def constant(value: float, device: str, mode: str) -> Efficiencies:
    """`--efficiency F`: one figure for every phase."""
    if not 0 < value <= 1:
        raise ConfigError(f"--efficiency {value}: must be in (0, 1] (the fraction of the bf16 peak reached)")
    f = Figure(value=value, source="override", basis="--efficiency (one figure for every phase)")
    return Efficiencies(device=device, mode=mode, capture=f, replay=f, recompute=f,
                        prompt_backward=f if mode == "exact" else None, measured_on="")


def run_kernels(cfg) -> dict:
    """{"gdn": ..., "attention": ...}: what the run's `ops` section takes on CUDA (ops/kernel_choice.py)."""
    from longstraw_mcore.ops.kernel_choice import attention_kernel_name, gdn_kernel_name
    from longstraw_mcore.parallel.cp import gdn_path

    m = cfg.model
    gdn = gdn_kernel_name(cfg.ops.gdn, "cuda", m.dtype) if gdn_path(m, 1, 1) is not None else "none"
    attention = attention_kernel_name(cfg.ops.attention, "cuda", m.dtype, getattr(m, "head_dim", 0))
    return {"gdn": gdn, "attention": attention}


def for_run(cfg, device: str, override: float | None) -> Efficiencies:
    """The figures a plan of `cfg` on `device` takes: `override` for every phase, or the table's row."""
    if override is not None:
        return constant(override, device, cfg.replay.mode)
    return efficiencies(device, cfg.replay.mode, **run_kernels(cfg))
