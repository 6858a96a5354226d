"""The devices `longstraw plan` knows (`--device`): memory, dense bf16 peak and HBM bandwidth, the one
home of those figures (planner/memory.py checks the memory, planner/timing.py and planner/efficiency.py
take the peak and bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from longstraw_mcore.config import ConfigError


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    bf16_flops: float
    """Dense bf16 peak, FLOP/s."""
    hbm_bytes_per_s: float
    """HBM bandwidth, bytes/s (NVIDIA's data sheets: H200 4.8 TB/s, H100 SXM 3.35 TB/s, H20 4.0 TB/s).
    NVIDIA publishes none for the 141 GB H20 (HBM3e; resellers list 4.8 TB/s): the 96 GB part's 4.0 TB/s,
    the slower choice, until one is measured. planner/efficiency.py derives the figures of the devices
    not measured by it."""


# peaks: NVIDIA's data sheets (H100 / H200 SXM: 1,979 TFLOP/s bf16 with sparsity, 989 dense; H20: 148 dense)
DEVICE_PROFILES = {
    "H20-96GB": DeviceProfile("H20-96GB", 96 * 10**9, 148e12, 4.0e12),
    "H20-141GB": DeviceProfile("H20-141GB", 141 * 10**9, 148e12, 4.0e12),
    "H100-80GB": DeviceProfile("H100-80GB", 80 * 10**9, 989e12, 3.35e12),
    "H200-141GB": DeviceProfile("H200-141GB", 141 * 10**9, 989e12, 4.8e12),
}


def device_profile(name: str, memory_gib: float | None = None) -> DeviceProfile:
    """`--device NAME` with `--device-gib` overriding its memory."""
    if name not in DEVICE_PROFILES:
        raise ConfigError(f"--device {name!r}: not a known device profile; known: {sorted(DEVICE_PROFILES)}")
    d = DEVICE_PROFILES[name]
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--device-gib {memory_gib}: must be > 0")
        d = replace(d, memory_bytes=int(memory_gib * 2**30))
    return d
