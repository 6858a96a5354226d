"""The tiny GLM-5.3-Flash config (configs/glm5.3-flash-tiny.yaml: KDA, KDA, KDA, MLA + pooled DSA, twice; 3 dense then
MoE of 4 experts; 4 residual streams; pools of 4 tokens) runs `longstraw validate` on 4 gloo ranks (TP=2 x PP=2 with
stages of 4 + 4 layers, EP=2, exact mode, float64) from a Megatron checkpoint converted from a Hugging Face directory,
and equals the same step on one rank from the HF directory: loss, every per-token log-prob and every gradient
<= 1e-10. The receipt lists every layer with its kind (KDA / full MLA, dense / MoE), the ranks that ran it (its
pipeline stage's), the experts its tokens reached and the EP rank of each, its prompt state (KDA: a constant state,
nothing per position; MLA: the latent per position plus a pooled index key per pool), the IndexShare schedule (the
indexer runs in the MLA layers only) and the measured prompt state of each run equals the analytic bytes of the
largest rank's layers."""

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


def _constant_tensors(hf) -> list[str]:
    """The tensors of the HF directory whose entries are all equal (tools/make_hf_model.py moves every vector and
    every constant matrix; models/glm5_next.py draws the streams' fn maps)."""
    from safetensors.torch import load_file

    w = load_file(str(hf / "model.safetensors"))
    return [k for k in sorted(w) if w[k].numel() > 1 and bool((w[k] == w[k].flatten()[0]).all())]


def _kda_state_bytes(m, tp: int, e: int) -> int:
    """One KDA layer's state on a TP rank: the conv window over q, k, v ((W - 1) x 3 H K channels) and the recurrent
    state (H x K x K), H = KDA heads / tp, float64 both."""
    H, K = m.linear_num_heads // tp, m.linear_head_dim
    return ((m.linear_conv_kernel_dim - 1) * 3 * H * K + H * K * K) * e


def _mla_state_bytes(m, tp: int, n: int, e: int) -> int:
    """One MLA layer's prompt state on the largest TP rank for n positions: its stripe of the latent (ceil(n / tp)
    rows of kv_lora_rank, no RoPE key), the pooled index key of every complete pool (replicated), and the raw index
    keys and gate scores of the incomplete last pool's positions."""
    pools, tail = divmod(n, m.index_kpool)
    return (-(-n // tp) * m.kv_lora_rank + pools * m.index_head_dim + 2 * tail * m.index_head_dim) * e


def test_glm_5_3_flash_validate_on_4_ranks_equals_one_rank(tmp_path):
    import time
    from concurrent.futures import ThreadPoolExecutor

    from compare_validate import compare
    from make_rollouts import make_groups
    from safetensors.torch import load_file

    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import write_rollouts

    cfg = "configs/glm5.3-flash-tiny.yaml"
    hf, mc, roll = tmp_path / "hf", tmp_path / "mc", tmp_path / "r.jsonl"
    t0 = time.perf_counter()
    _tool("tools/make_hf_model.py", str(hf), "--config", cfg, "--seed", "3", "model.dtype=float64")
    constant = _constant_tensors(hf)
    m = load_config(cfg).model
    assert m.layer_types == ["kda"] * 3 + ["mla_dsa_full"] + ["kda"] * 3 + ["mla_dsa_full"]
    # only the routers' correction biases (a buffer the policy gradient does not move: zero in a fresh model)
    assert constant and all(k.endswith("e_score_correction_bias") for k in constant), constant
    P, C = 18, 5  # a prompt of 18: 17 positions captured in chunks of 5 (4 chunks), 4 complete pools + a tail of 1
    groups = make_groups(m.vocab_size, 1, P, 3, 8, seed=2)  # one group (no data parallelism left)
    assert [len(r) for r in groups[0].responses] == [8, 3, 6]
    assert (P - 1) // m.index_kpool > m.index_topk // m.index_kpool  # the selection is sparse: 2 of 4+ pools
    write_rollouts(roll, groups)
    common = ("--rollouts", str(roll), "--mode", "exact", "--dump-grads", f"replay.chunk_len={C}", "device=cpu")
    t1 = time.perf_counter()
    # the conversion (for the four ranks) beside the one-rank run from the HF directory: two one-process jobs
    with ThreadPoolExecutor(max_workers=1) as pool:
        conv = pool.submit(_tool, "tools/convert_checkpoint.py", "hf-to-mcore", str(hf), str(mc), "--tp", "2",
                           "--ep", "2")
        one = longstraw(1, "validate", "--hf", str(hf), "--out", str(tmp_path / "one"), *common, timeout=600)
        conv.result()
    assert one.returncode == 0, one.stderr[-3000:]
    t2 = time.perf_counter()
    four = longstraw(4, "validate", "--config", cfg, "--load", str(mc), "--out", str(tmp_path / "four"), *common,
                     "parallel.tp=2", "parallel.pp=2", "parallel.pp_layers=[4,4]", "parallel.ep=2",
                     "model.dtype=float64", timeout=600)
    assert four.returncode == 0, four.stderr[-3000:]
    print(f"setup {t1 - t0:.1f} s, one rank (beside the conversion) {t2 - t1:.1f} s, four ranks "
          f"{time.perf_counter() - t2:.1f} s")
    diff = compare(tmp_path / "four", tmp_path / "one")
    r = json.loads((tmp_path / "four" / "receipt.json").read_text())
    r1 = json.loads((tmp_path / "one" / "receipt.json").read_text())
    print(f"GLM-5.3-Flash tiny, TP=2 x PP=2, EP=2 vs one rank (exact, float64): loss {diff['loss']:.1e}, logp "
          f"{diff['logprob_abs']:.1e}, worst gradient {diff['grad_worst']:.1e} ({diff['grad_worst_name']}); state "
          f"{r['state_bytes_per_group'][0]} B (4 ranks), {r1['state_bytes_per_group'][0]} B (1 rank); "
          f"{r['state_bytes_per_position']} B/position + {r['state_bytes_constant']} B; seconds {r['seconds']}")
    assert diff["loss"] <= 1e-10 and diff["logprob_abs"] <= 1e-10 and diff["grad_worst"] <= 1e-10
    assert r["layout"] == {"tp": 2, "pp": 2, "cp": 1, "ep": 2, "dp": 1, "world_size": 4}
    assert r["mode"] == "exact" and r["skipped_groups"] == [] and r["response_tokens"] == 17

    # the indexer gets no gradient (transformers runs it under no_grad), though its inputs now vary
    for d in ("one", "four"):
        g = load_file(str(tmp_path / d / "grads.safetensors"))
        idx = [k for k in g if ".self_attn.indexer." in k]
        assert len(idx) == 2 * 7 and all(not g[k].any() for k in idx)
        assert all(g[k].abs().max() > 0 for k in g if ".hc_" in k and "_scale" in k)  # the streams' scales learn
    assert r["indexer_gradient"].startswith("none")
    mla = [i for i, t in enumerate(m.mixer_types) if t == "indexed_attention"]
    assert r["index_share_schedule"]["full_layers"] == mla == [3, 7]  # not the KDA layers' unused "full"

    assert r["layers_touched"] == r["num_layers"] == 8 == len(r["layers"])
    e8 = 8  # float64
    kda, per_mla = _kda_state_bytes(m, 1, e8), (m.kv_lora_rank + m.index_head_dim // m.index_kpool) * e8
    assert (kda, per_mla) == (2176, 112)  # (3 x 48 + 2 x 64) x 8; (12 + 8 / 4) x 8
    for e, e1 in zip(r["layers"], r1["layers"]):
        i = e["layer"]
        assert e["type"] == ("mla_dsa_full" if i in mla else "kda")
        assert e["mlp"] == ("dense" if i < 3 else "moe")
        assert e["ranks_touched"] == ([0, 1] if i < 4 else [2, 3]), e  # both TP ranks of the layer's stage
        assert e1["ranks_touched"] == [0]
        # KDA: a constant state, nothing per position; MLA: the latent and a pooled key's share per position
        assert (e["state_bytes_per_position"], e["state_bytes_constant"]) == ((per_mla, 0) if i in mla else (0, kda))
        assert all(e[k] == e1[k] for k in ("type", "mlp", "state_bytes_per_position", "state_bytes_constant"))
        if i < 3:
            assert "tokens_per_expert" not in e
            continue
        assert e["ep_rank_of_expert"] == [0, 0, 1, 1]  # two experts per EP rank
        four_t, one_t = e["tokens_per_expert"], e1["tokens_per_expert"]
        assert e["experts_touched"] >= 2 and any(four_t[:2]) and any(four_t[2:])  # both EP ranks' experts ran
        # one rank: top-2 of each token the layer ran: the capture and exact mode's recompute (17 positions each,
        # all but the last layer, which only produces its state) and the replay (3 branches, padded to 8)
        assert sum(one_t) == m.num_experts_per_tok * (3 * 8 + (0 if i == 7 else 2 * (P - 1)))
        # four ranks: the same tokens, and (TP=2) the capture chunks of odd length padded by one token each
        assert sum(four_t) % m.num_experts_per_tok == 0 and all(a >= b for a, b in zip(four_t, one_t))
    assert r["state_bytes_per_position"] == 2 * per_mla and r["state_bytes_constant"] == 6 * kda

    # the measured prompt state (the largest rank's) = the analytic bytes of its layers: KDA keeps its state and, in
    # exact mode, the state entering each later capture chunk; MLA its latent stripe, pooled keys and tail
    chunks = -(-(P - 1) // C)
    assert r1["state_bytes_per_group"] == [6 * chunks * kda + 2 * _mla_state_bytes(m, 1, P - 1, e8)] == [56256]
    stage = 3 * chunks * _kda_state_bytes(m, 2, e8) + _mla_state_bytes(m, 2, P - 1, e8)  # both stages alike
    assert r["state_bytes_per_group"] == [stage] == [14304]
