"""flash-linear-attention's Triton kernels equal the plain twins, run on the CPU under Triton's interpreter
(ops/triton_interpret.py): tests/fla_interpreter_checks.py in a fresh process with TRITON_INTERPRET=1
(it must be set before fla's kernels are decorated), every output, state and gradient, the state
gradients included, within 1e-5 of the twin's largest entry (float32; measured 3e-8 to 9e-7). Also the
dispatch (`ops.gdn=fla` runs fla on CPU tensors only under the interpreter, `auto` keeps the twin on CPU,
float64 is refused naming the dtype) and the Hopper gate of fla issue #640 with the device test forced
true (key dim 16 refused, 128 run with fla's flag lifted for the call and restored). Kimi Delta Attention's
rule the same way (ops/fla_kda.py against ops/kda.py, its dispatch under `ops.gdn`; measured 1e-7 to 4e-6).
What this cannot see: a GPU-only miscompile; scripts/gpu_check.sh compares the CUDA kernels with the twins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5


@pytest.fixture(scope="module")
def checks():
    pytest.importorskip("fla", reason="fla-core (the test extra) holds the kernels under test")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fla_interpreter_checks.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_kernels_equal_the_twins(checks):
    cases = [c for c in checks if c.startswith(("rule_", "piece_", "conv_")) and c != "conv_empty"]
    assert len(cases) == 7, cases
    drift = {f"{c}.{t}": e for c in cases for t, e in checks[c].items() if not e <= TOL}
    assert not drift, f"fla vs twin beyond {TOL}: {drift}"
    # every use's state gradients are among the compared tensors
    assert {"d_s0", "final_state"} <= set(checks["rule_grouped_state"]) and "d_s0" in checks["conv_window"]
    assert checks["conv_empty"]["shape"] == [1, 0, 24, 1, 24, 3]


def test_dispatch_and_hopper_gate(checks):
    d, g = checks["dispatch"], checks["gate"]
    assert d["fla_forced_cpu_float32"] and d["auto_cpu_is_plain"]
    assert "values are torch.float64" in d["fla_float64_error"] and "ops.gdn=auto" in d["fla_float64_error"]
    assert "fla issue #640" in g["missing_k16"] and g["missing_k128"] is None
    assert "#640" in g["backward_k16"] and g["backward_k128"] == "ran"
    assert g["flag_after_k16"] is False and g["flag_after_k128"] is False


def test_kda_kernels_equal_the_twin(checks):
    """Kimi Delta Attention (ops/fla_kda.py against ops/kda.py: tests/fla_kda_checks.py): with and without an
    initial state, a state carried into a one-token step, GLM-5.3-Flash's bounded gate at its initial (strong)
    decay through fla's bounded-gate path and its general one, the piece maps (values K + V wide)."""
    want = {"kda_rule_state", "kda_rule_no_state", "kda_carried", "kda_bounded_strong", "kda_bounded_strong_general",
            "kda_piece_maps"}
    assert want <= set(checks), sorted(checks)
    drift = {f"{c}.{t}": e for c in want for t, e in checks[c].items() if not e <= TOL}
    assert not drift, f"fla KDA vs twin beyond {TOL}: {drift}"
    grads = {"d_q", "d_k", "d_v", "d_g", "d_beta"}
    assert all(grads <= set(checks[c]) for c in want)
    assert {"d_s0", "final_state"} <= set(checks["kda_rule_state"]) and "d_s0" in checks["kda_carried"]
    assert {"c", "o0", "M", "B"} <= set(checks["kda_piece_maps"])
    lo, mean, hi = checks["kda_gate_range"]  # the strong decay: bounded at -5, most steps near it
    assert lo >= -5.0 and mean < -4.0 and hi <= 0.0


def test_kda_dispatch_under_the_interpreter(checks):
    d = checks["kda_dispatch"]
    assert d["fla_forced_cpu_float32"] and d["auto_cpu_is_plain"]
    assert d["bounded"] == [True, {"lower_bound": -5.0}]
    assert "values are torch.float64" in d["error_float64"] and "ops.gdn=auto or plain" in d["error_float64"]
    assert "key dim 300 > 256" in d["error_key_dim_300"]
    assert d["kernels"] == {"kda_rule": {"fla": 2, "plain": 2}}
    assert d["empty"] == {"shape": [1, 0, 2, 8, 1, 2, 16, 8], "state_kept": True}
