"""memory.host_heap: under `retain` a steady loop of large tensors faults no new pages in; under glibc's
default every cycle of a block above the mmap threshold does (memory/host_heap.py). Each policy runs in
its own process: the setting is process-wide and one-way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from longstraw_mcore.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 64                   # above glibc's largest mmap threshold (32 MiB): its own mapping under `system`
CYCLES = 5
PAGES = CYCLES * MIB * 256  # 4 KiB pages touched by the timed cycles

CHILD = f"""
import json, resource, sys, torch
from longstraw_mcore.memory import host_heap
host_heap.apply(sys.argv[1])
def cycle():
    for mib in ({MIB}, 8, {MIB}):       # a step's large tensors, freed and allocated again
        x = torch.empty(mib << 18)
        x.fill_(1.0)
        del x
for _ in range(10):                     # first touch, and the heap settling to the loop's high-water
    cycle()                             # mark (alignment splits a freed block the first times round)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({CYCLES}):
    cycle()
print(json.dumps({{"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                   "applied": host_heap.applied()}}))
"""


def _faults(policy: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", CHILD, policy], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_retain_keeps_freed_memory_and_config_checks():
    retain, system = _faults("retain"), _faults("system")
    assert retain["applied"] == "retain" and system["applied"] == "system"
    # two 64 MiB blocks per cycle; retained, they come back from the heap with their pages resident
    assert retain["faults"] < 0.01 * 2 * PAGES, (retain, PAGES)
    if not _thp_always():  # (with transparent huge pages always on, glibc's mappings fault 2 MiB at a time)
        assert system["faults"] > 0.5 * 2 * PAGES, (system, PAGES)
    cfg = load_config("configs/bench-hybrid-256.yaml")
    assert cfg.memory.host_heap == "retain"
    assert load_config("configs/qwen3.6-tiny.yaml").memory.host_heap == "system"
    with pytest.raises(ConfigError, match=r"memory.host_heap='keep'.*'system', 'retain'"):
        load_config("configs/qwen3.6-tiny.yaml", ["memory.host_heap=keep"])
