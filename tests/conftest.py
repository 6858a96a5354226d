"""Test-wide set-up: make tests/ importable (shared reference builders live there) for the test
process and, through sys.path, for the ranks it spawns; and bind transformers' Qwen3.5 and GLM-5.3-Flash
references to their own torch delta rules (Gated DeltaNet, Kimi Delta Attention) before anything imports
them (flash-linear-attention is installed for the Triton interpreter tests, and transformers would
otherwise bind fla's kernels: bench/hf_kernels.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from longstraw_mcore.bench.hf_kernels import glm5_next_modeling, qwen3_5_modeling  # noqa: E402

qwen3_5_modeling(fla=False)
glm5_next_modeling(fla=False)

# pytest-xdist workers (scripts/test.sh runs two): each worker's launches pick rendezvous ports from a range
# of their own, below the kernel's ephemeral ports, so two tests launching at once never take one port
# (longstraw_mcore/launch_local.py `free_port`).
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "LONGSTRAW_PORTS" not in os.environ:
    _lo = 20000 + 1000 * int(_worker[2:])  # (up to gw11: below 32768)
    os.environ["LONGSTRAW_PORTS"] = f"{_lo}-{_lo + 999}"
