"""`TRITON_INTERPRET=1 longstraw validate ... ops.dsa=triton` on a GLM model equals the twin's `validate`
(float32, exact mode, on the CPU): every DSA use through the project's Triton kernels (the indexer's
fused scores under the twin's selection, sparse MLA forward and backward), run by Triton's interpreter, against `ops.dsa=plain`.
The model: GLM-5.2's tiny width (configs/glm-5.2-tiny.yaml) cut to 4 layers (three full indexer layers and
a shared one, top-k 8 of a 40-token prompt: the sparse regime), transformers-layout weights. The group
exercises capture in chunks of 16, the replay of the branches, exact mode's sweep (the latents' and RoPE
keys' gradients scatter-added into the prompt state's leaves) and prefix-tree segments (two pairs of
responses sharing their first tokens); at one rank and at CP=2 (the state sharded by sequence, the
kernels' per-rank proposals merged into the global top-k, their partial attention merged by
log-sum-exp). Loss and log-probs within 1e-5 relative, every gradient within 1e-5 of its own largest
entry, and the receipts' `kernels` say which kernel ran (triton for dsa_indexer and dsa_attention, never
the twin, under ops.dsa=triton). Not covered: CUDA (the GPU check), bf16. The twin's run and the one-rank
Triton run are independent one-process jobs: they go side by side on the two cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from interpreter_validate import check_equal, validate, write_tree_group
from launch import ROOT

TOL = 1e-5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    pytest.importorskip("triton", reason="Triton (the test extra) runs the kernels under its interpreter")
    tmp = tmp_path_factory.mktemp("dsa_validate")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "tools/make_hf_model.py", str(tmp / "hf"), "--config", "configs/glm-5.2-tiny.yaml",
                        "--seed", "3", "model.num_layers=4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    write_tree_group(tmp / "r.jsonl", 256, 40)
    return tmp


def test_dsa_kernels_validate_equals_the_twin(case):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:  # the two one-rank runs side by side: two cores
        triton1 = pool.submit(validate, case, "triton", 1, "ops.dsa=triton", interpret=True, chunk_len=16)
        twin, tr = validate(case, "plain", 1, "ops.dsa=plain", interpret=False, chunk_len=16)
        triton1 = triton1.result()
    assert set(tr["kernels"]["dsa_indexer"]) == {"plain"} and set(tr["kernels"]["dsa_attention"]) == {"plain"}
    assert tr["seconds"].get("prompt_backward", 0) > 0
    assert tr["replayed_tokens"] < tr["response_tokens"]  # the shared prefixes ran once, as segments
    worst = {"triton": check_equal("triton", *triton1, twin, tr, ("dsa_indexer", "dsa_attention"), "triton", TOL)}
    for name, ranks, extra in [("triton_cp2", 2, ("parallel.cp=2",))]:
        out, rec = validate(case, name, ranks, "ops.dsa=triton", *extra, interpret=True, chunk_len=16)
        worst[name] = check_equal(name, out, rec, twin, tr, ("dsa_indexer", "dsa_attention"), "triton", TOL)
    print("DSA kernels under the interpreter vs the twin:", worst)
