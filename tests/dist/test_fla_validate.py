"""`TRITON_INTERPRET=1 longstraw validate ... ops.gdn=fla` equals the twin's `validate` (float32, exact mode,
on the CPU): every Gated DeltaNet use through flash-linear-attention's Triton kernels, run by Triton's
interpreter (ops/triton_interpret.py), against `ops.gdn=plain` at one rank. The group exercises
  - capture: three prompt chunks, the recurrent state and conv window carried between them;
  - replay: the branches from the captured state (the receipt's log-probs);
  - exact mode's sweep: each chunk recomputed from its entering state, seeded with the gradient of the
    state it leaves, depositing into the one before (the initial- and final-state gradients of fla);
  - prefix-tree segments: two pairs of responses sharing their first tokens (replayed once, their GDN
    state a leaf the tails read);
  - context parallelism at CP=2, by head shards (`model.gdn_cp=heads`: the all-to-all exchange) and by
    sequence pieces (`model.gdn_cp=sequence`: the piece maps on values K wider and the scan).
Loss and log-probs within 1e-5 relative, every gradient within 1e-5 of its own largest entry (the HF
reference's weights keep the decay meaningful: A in [0.05, 1]), and the receipts' `kernels` say which
kernel ran (fla for gdn_rule and gdn_conv, never the twin, under ops.gdn=fla). Not covered: CUDA (the GPU
check), bf16 (fla's rounding differs by design), TP (the same per-rank calls on fewer heads). The
twin's run and the one-rank fla run are independent one-process jobs: they go side by side on two cores."""

from __future__ import annotations

import pytest
from interpreter_validate import check_equal, validate, write_tree_group

TOL = 1e-5


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    pytest.importorskip("fla", reason="fla-core (the test extra) holds the kernels under test")
    from hf_reference import build_hf_model, tiny_model_config

    tmp = tmp_path_factory.mktemp("fla_validate")
    m = tiny_model_config(num_layers=2, full_attention_interval=2, linear_key_head_dim=16, linear_value_head_dim=16,
                          dtype="float32")
    build_hf_model(m, seed=5).save_pretrained(tmp / "hf")
    write_tree_group(tmp / "r.jsonl", m.vocab_size, 90)
    return tmp


def test_fla_validate_equals_the_twin(case):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:  # the two one-rank runs side by side: two cores
        fla1 = pool.submit(validate, case, "fla", 1, "ops.gdn=fla", interpret=True, chunk_len=32)
        twin, tr = validate(case, "plain", 1, "ops.gdn=plain", interpret=False, chunk_len=32)
        fla1 = fla1.result()
    assert tr["kernels"]["gdn_rule"] == {"plain": tr["kernels"]["gdn_rule"]["plain"]} and "fla" not in tr["kernels"]["gdn_conv"]
    assert tr["seconds"].get("prompt_backward", 0) > 0
    assert tr["replayed_tokens"] < tr["response_tokens"]  # the shared prefix ran once, as a segment
    runs = [("fla_cp2_heads", 2, ("parallel.cp=2", "model.gdn_cp=heads")),
            ("fla_cp2_sequence", 2, ("parallel.cp=2", "model.gdn_cp=sequence"))]
    worst = {"fla": check_equal("fla", *fla1, twin, tr, ("gdn_rule", "gdn_conv"), "fla", TOL)}
    for name, ranks, extra in runs:
        out, rec = validate(case, name, ranks, "ops.gdn=fla", *extra, interpret=True, chunk_len=32)
        worst[name] = check_equal(name, out, rec, twin, tr, ("gdn_rule", "gdn_conv"), "fla", TOL)
    print("fla under the interpreter vs the twin:", worst)
