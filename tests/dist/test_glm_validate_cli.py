"""The 78-layer, tiny-width GLM-5.2 config (configs/glm-5.2-tiny.yaml: GLM-5.2's IndexShare schedule,
3 dense + 75 MoE layers) runs `longstraw validate` on 8 gloo ranks (TP=2 x PP=2 with stages of 38 + 40
layers x CP=2, EP=2, exact mode, float64) from a Megatron checkpoint converted from a Hugging Face directory,
and equals the same step on one rank from the HF directory: loss, every per-token log-prob and every
gradient <= 1e-10. The receipt lists every layer with its kind (dense/MoE, full/shared indexer), the
ranks that ran it (its pipeline stage's), the experts its tokens reached and the EP rank of each, its
state bytes per position; the IndexShare schedule; and the measured prompt state equals the analytic
bytes per position of a stage's layers times the positions its CP rank keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import ROOT, longstraw_forked as longstraw  # (ranks forked preloaded: the CLI's main())

sys.path.insert(0, os.path.join(ROOT, "tools"))


def _tool(*argv):
    import time

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    print(f"{argv[0]}: {time.perf_counter() - t:.1f} s")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_glm_5_2_78_layers_validate_on_8_ranks_equals_one_rank(tmp_path):
    from compare_validate import compare
    from make_rollouts import make_groups

    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import write_rollouts

    cfg = "configs/glm-5.2-tiny.yaml"
    hf, mc, roll = tmp_path / "hf", tmp_path / "mc", tmp_path / "r.jsonl"
    _tool("tools/make_hf_model.py", str(hf), "--config", cfg, "--seed", "3", "model.dtype=float64")
    m = load_config(cfg).model
    P, G = 13, 2
    write_rollouts(roll, make_groups(m.vocab_size, 1, P, G, 3, seed=5))  # one group: no data parallelism left
    common = ("--rollouts", str(roll), "--mode", "exact", "--dump-grads", "replay.chunk_len=12", "device=cpu")
    import time
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    # the conversion (for the eight ranks) beside the one-rank run from the HF directory: two independent
    # one-process jobs, two cores
    with ThreadPoolExecutor(max_workers=1) as pool:
        conv = pool.submit(_tool, "tools/convert_checkpoint.py", "hf-to-mcore", str(hf), str(mc), "--tp", "2",
                           "--ep", "2")
        one = longstraw(1, "validate", "--hf", str(hf), "--out", str(tmp_path / "one"), *common, timeout=600)
        conv.result()
    assert one.returncode == 0, one.stderr[-3000:]
    t1 = time.perf_counter()
    eight = longstraw(8, "validate", "--config", cfg, "--load", str(mc), "--out", str(tmp_path / "eight"), *common,
                      "parallel.tp=2", "parallel.pp=2", "parallel.pp_layers=[38,40]", "parallel.cp=2", "parallel.ep=2", "model.dtype=float64",
                      timeout=900)
    assert eight.returncode == 0, eight.stderr[-3000:]
    print(f"one rank (beside the conversion) {t1 - t0:.1f} s, eight ranks {time.perf_counter() - t1:.1f} s")
    diff = compare(tmp_path / "eight", tmp_path / "one")
    r = json.loads((tmp_path / "eight" / "receipt.json").read_text())
    print(f"GLM-5.2 tiny, 78 layers, TP=2 x PP=2 x CP=2, EP=2 vs one rank (exact, float64): loss {diff['loss']:.1e}, logp "
          f"{diff['logprob_abs']:.1e}, worst gradient {diff['grad_worst']:.1e} ({diff['grad_worst_name']}); "
          f"{r['layers_touched']} layers touched, state {r['state_bytes_per_group'][0]} B = "
          f"{r['state_bytes_per_position']} B/position x {P - 1}; seconds {r['seconds']}")
    assert diff["loss"] <= 1e-10 and diff["logprob_abs"] <= 1e-10 and diff["grad_worst"] <= 1e-10

    assert r["layout"] == {"tp": 2, "pp": 2, "cp": 2, "ep": 2, "dp": 1, "world_size": 8}
    assert r["layers_touched"] == r["num_layers"] == 78 == len(r["layers"])
    full = [i for i, t in enumerate(m.indexer_types) if t == "full"]
    assert r["index_share_schedule"]["full_layers"] == full == [0, 1, 2] + list(range(6, 78, 4))
    assert r["indexer_gradient"].startswith("none")
    for e in r["layers"]:
        i = e["layer"]
        assert e["type"] == ("mla_dsa_full" if i in full else "mla_dsa_shared")
        assert e["mlp"] == ("dense" if i < 3 else "moe")
        stage = [0, 1, 2, 3] if i < 38 else [4, 5, 6, 7]  # Megatron's rank order: pipeline outermost
        assert e["ranks_touched"] == stage, e  # every TP and CP rank of the layer's stage ran it
        if i >= 3:  # two experts per EP rank; the routed tokens add up to top-k per token
            assert e["ep_rank_of_expert"] == [0, 0, 1, 1] and e["experts_touched"] >= 2
            assert sum(e["tokens_per_expert"]) % m.num_experts_per_tok == 0
        # MLA latent (kv_lora_rank + RoPE key) on every layer, the indexer key on full layers, float64
        want = (m.kv_lora_rank + m.qk_rope_head_dim + (m.index_head_dim if i in full else 0)) * 8
        assert e["state_bytes_per_position"] == want
    # measured prompt state (the largest rank: its stage's layers x the positions it keeps: its CP rank's
    # share of the P - 1 captured in chunks of 8, striped over the 2 TP ranks) = analytic x positions
    from longstraw_mcore.parallel.cp import local_count

    assert r["state_bytes_per_position"] == (16 * 78 + 8 * 21) * 8
    per_stage = [sum(e["state_bytes_per_position"] for e in r["layers"][a:b]) for a, b in ((0, 38), (38, 78))]
    kept = max(len(range(t, local_count(8, 2, c) + local_count(P - 1 - 8, 2, c), 2)) for c in range(2)
               for t in range(2))
    assert kept == 3  # of 12 positions: 1/(tp cp) each
    assert r["state_bytes_per_group"] == [max(per_stage) * kept]
