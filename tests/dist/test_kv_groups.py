"""Tensor parallelism beyond the KV heads (KV groups, parallel/kv_group.py) equals a single rank.

Four gloo ranks, float64, a tiny hybrid model with 2 KV heads at TP=4: each KV head is shared by two
TP ranks (a KV group) that compute it in full and keep half of its prompt positions each (zig-zag
pieces of every chunk). Why the result must not depend on it: the group's partials over its two
state shards are one softmax merged by log-sum-exp; the replicated K/V projections and k-norm get
identical gradients in the group, their input gradient scaled by 1/2 before the TP all-reduce so the
head counts once; exact mode's recompute seeds the replicated chunk K/V with every position's
gradient (assembled from the shards).

Checked against TP=1 (<= 1e-10): logits; branch replay (detached and exact) loss, log-probs and every
parameter gradient; the global gradient norm (replicated projections counted once); a checkpoint
saved at TP=4 loads at TP=1 with identical logits. Per-rank K/V bytes: one head, half the positions.
Not covered here: KV groups with context parallelism (tests/dist/test_cp_sequence_gdn.py), CUDA.
"""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _worker(rank, world_size, tmpdir):
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from hf_reference import build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import grads_and_loss, make_group

    from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.models.language_model import gather_vocab
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.parallel.reduce import grad_norm
    from longstraw_mcore.replay.engine import capture, run_group

    m = tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)  # 4 q heads, 2 KV heads
    full = hf_to_mcore(hf_state(build_hf_model(m, seed=81)), m)
    group = make_group(m, 30, [3, 1, 7, 2, 5], seed=82)
    ids = torch.randint(0, m.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    res = {}
    for tp in (1, 4):
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=tp), device="cpu"))
        model = build_model(m, par, "cpu")
        load_full(model, full)
        r = {"logits": gather_vocab(model(ids), par.pgs.tp).detach()}
        for mode in ("detached", "exact"):
            cfg = ReplayConfig(mode=mode, chunk_len=8)
            r[mode] = grads_and_loss(model, group, GRPOConfig(beta=0.05), lambda fn: [
                x.logprobs for x in run_group(model, group.prompt, group.responses, fn, cfg)[0]])
            r[mode + "_norm"] = grad_norm(model, par)
        r["kv_bytes"] = capture(model, torch.tensor([group.prompt[:-1]]), ReplayConfig(chunk_len=8)).nbytes_by_type()[
            "attention_kv"]
        if tp == 4:
            save_checkpoint(model, Path(tmpdir) / "ckpt", m, par.layout())
        res[tp] = r
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=1), device="cpu"))
    model = build_model(m, par, "cpu")
    load_checkpoint(model, Path(tmpdir) / "ckpt")
    reload_equal = torch.equal(gather_vocab(model(ids), par.pgs.tp).detach(), res[1]["logits"])
    out = {"logits": rel(res[4]["logits"], res[1]["logits"]), "reload_equal": reload_equal,
           "kv_bytes": (res[1]["kv_bytes"], res[4]["kv_bytes"])}
    for mode in ("detached", "exact"):
        (l1, lp1, g1), (l4, lp4, g4) = res[1][mode], res[4][mode]
        out[mode] = dict(loss=abs(l4 - l1) / abs(l1), logp=max(rel(a, b) for a, b in zip(lp4, lp1)),
                         grad=max(rel(g4[k], g1[k]) for k in g1),
                         norm=abs(res[4][mode + "_norm"] - res[1][mode + "_norm"]) / res[1][mode + "_norm"])
    return out


def test_tp4_with_two_kv_heads_equals_tp1(tmp_path):
    outs = run_ranks(_worker, 4, str(tmp_path), timeout_s=900)
    for rank, out in enumerate(outs):
        if rank == 0:
            print(f"TP=4, 2 KV heads vs TP=1: logits {out['logits']:.1e}; " + "; ".join(
                f"{mode}: loss {out[mode]['loss']:.1e}, logp {out[mode]['logp']:.1e}, grad {out[mode]['grad']:.1e}, "
                f"grad norm {out[mode]['norm']:.1e}" for mode in ("detached", "exact")))
        assert out["logits"] <= 1e-10 and out["reload_equal"]
        for mode in ("detached", "exact"):
            r = out[mode]
            assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10 and r["norm"] <= 1e-10, (mode, r)
    per_rank = [o["kv_bytes"][1] for o in outs]
    single = outs[0]["kv_bytes"][0]
    print(f"K/V bytes per rank {per_rank} (single rank: {single}; one head of two, half the positions)")
    assert sum(per_rank) == single  # each (head, position) on exactly one rank: no replication
