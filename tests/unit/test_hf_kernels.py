"""The transformers reference runs its own torch Gated DeltaNet rule although flash-linear-attention is
installed (bench/hf_kernels.py). With fla importable, a plain first import of transformers' Qwen3.5
modeling binds fla's kernel (shown here, so the guard is known to be needed); imported through
`qwen3_5_modeling(fla=False)` it binds the torch rule, and asking a process for the other binding
afterwards is an error, never a silent switch. This test process itself (tests/conftest.py) holds the
torch binding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import importlib, sys
from longstraw_mcore.bench.hf_kernels import gdn_path, qwen3_5_modeling
first = sys.argv[1]
if first == "raw":
    m = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
else:
    m = qwen3_5_modeling(fla=first == "fla")
print("bound", gdn_path(m))
other = first == "torch"  # the binding this process does not have
try:
    qwen3_5_modeling(fla=other)
    print("second ok")
except RuntimeError as e:
    print("second refused:", e)
"""


def _run(first: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _SCRIPT, first], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_reference_binds_the_torch_rule_with_fla_installed():
    pytest.importorskip("fla", reason="the hazard exists only where fla is installed (the test extra has it)")
    from longstraw_mcore.bench.hf_kernels import _MODULE, gdn_path

    assert gdn_path(sys.modules[_MODULE]) == "torch"  # this process: tests/conftest.py
    raw = _run("raw")
    assert "bound fla" in raw and "second refused" in raw and "needs the torch rule" in raw, raw
    guarded = _run("torch")
    assert "bound torch" in guarded and "second refused" in guarded and "needs the fla rule" in guarded, guarded
