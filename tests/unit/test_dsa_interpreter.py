"""The project's DSA Triton kernels equal the plain twins, run on the CPU under Triton's interpreter:
tests/dsa_interpreter_checks.py in a fresh process with TRITON_INTERPRET=1, float32.
  - the indexer (ops/dsa_triton_indexer.py: fused scores, the twin's selection, key steps of its own size
    across the two key parts too): the same rows (exactly) and validity, and
    scores within 1e-5, in the dense regime (k above the key count), the sparse one, with many exact-zero
    ties (broken toward the earlier position as the twin breaks them), and over a CP rank's counted rows;
  - sparse MLA (ops/dsa_triton_mla.py): o_lat, lse and every gradient (queries, W_UK, and the latents and
    RoPE keys where they take one) within 1e-5 relative, with an upstream gradient into lse as the CP merge
    gives it; a detached prompt state gets no gradient; the one-rank `mla_sparse` through W_UV;
  - keys and latents in two parts as the prompt state hands them over (its rows with batch 1, the call's
    own with batch B), read in place by the kernels, each part's gradient of its own shape (the state's
    none where it is detached);
  - CP=2 by hand: two zig-zag pieces, each piece's kernel top-k merged as the ranks merge them, each
    piece's partial attention merged by log-sum-exp, equal to the twin's one-rank selection and attention;
  - the dispatch: ops.dsa=triton runs the kernels on CPU float32 only under the interpreter, refuses
    float64 naming the dtype; auto keeps the twins on CPU."""

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
    pytest.importorskip("triton", reason="Triton (the test extra) runs the kernels under its interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "dsa_interpreter_checks.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_indexer_kernel_selects_as_the_twin(checks):
    for case in ("indexer_dense", "indexer_sparse", "indexer_ties", "indexer_counted"):
        c = checks[case]
        assert c["shape_equal"] and c["valid_equal"] and c["rows_equal"] and c["all_rows_equal"], (case, c)
        assert c["scores"] <= TOL, (case, c)
    assert checks["indexer_dense"]["valid_slots"] < checks["indexer_dense"]["slots"]  # fewer visible than k
    assert checks["indexer_ties"]["ties"] > checks["indexer_ties"]["slots"] // 2       # ties decide most slots


def test_sparse_mla_kernel_equals_the_twin(checks):
    for case in ("mla_partial_exact", "mla_partial_detached", "mla_partial_dense", "mla_full", "cp2_pieces",
                 "mla_parts_detached", "mla_parts_exact"):
        c = checks[case]
        drift = {k: v for k, v in c.items() if isinstance(v, float) and not v <= TOL}
        assert not drift, (case, drift)
    assert {"d_c_kv", "d_k_pe", "lse"} <= set(checks["mla_partial_exact"])
    assert checks["mla_partial_exact"]["lse_none_equal"] and checks["mla_partial_detached"]["detached_state_untouched"]
    assert "d_c_kv" not in checks["mla_partial_detached"]
    assert checks["cp2_pieces"]["selection_equal"] and "d_c_kv" in checks["cp2_pieces"]
    assert {"d_w_uv", "d_c_kv"} <= set(checks["mla_full"])
    # the state's rows and the call's own as two parts, read in place: each part's gradient its own shape
    assert checks["mla_parts_exact"]["shapes_equal"] and checks["mla_parts_detached"]["shapes_equal"]
    assert "d_state_c" in checks["mla_parts_exact"] and "d_state_c" not in checks["mla_parts_detached"]


def test_indexer_kernel_reads_keys_in_two_parts(checks):
    c = checks["indexer_parts"]
    assert c["rows_equal"] and c["valid_equal"] and c["scores"] <= TOL and c["tail_chosen"] > 0, c


def test_dsa_dispatch(checks):
    d = checks["dispatch"]
    assert d["triton_forced_cpu_float32"] and d["auto_cpu_is_plain"]
    assert "torch.float64" in d["triton_float64_error"] and "ops.dsa=auto" in d["triton_float64_error"]
