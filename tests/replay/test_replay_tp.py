"""Branch replay does not depend on tensor parallelism: TP=2 gives the TP=1 log-probs, loss and
gradients (float64, 1e-10) in both modes. Under TP the prompt state is sharded by kv head (attention)
and by head group (GDN conv channels and recurrent state), the log-softmax is vocab-parallel, and the
replicated norms' gradients are all-reduced in their backward; every one of those must be exact for
the gathered gradients to agree."""

from __future__ import annotations

from longstraw_mcore.launch_local import run_ranks


def _worker(rank, world_size):
    from hf_reference import build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import grads_and_loss, make_group, rel

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.loss.grpo import GRPOConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import ReplayConfig, run_group

    m = tiny_model_config(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                          linear_num_value_heads=4)
    full = hf_to_mcore(hf_state(build_hf_model(m, seed=5)), m)
    group = make_group(m, 19, [4, 1, 7], seed=21)
    gcfg = GRPOConfig(beta=0.05)
    res = {}
    for tp in (1, 2):
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=tp), device="cpu"))
        model = build_model(m, par, "cpu")
        load_full(model, full)
        for mode in ("detached", "exact"):
            cfg = ReplayConfig(mode=mode, chunk_len=6)
            res[(tp, mode)] = grads_and_loss(model, group, gcfg, lambda fn: [
                r.logprobs for r in run_group(model, group.prompt, group.responses, fn, cfg)[0]])
    out = {}
    for mode in ("detached", "exact"):
        (l1, lp1, g1), (l2, lp2, g2) = res[(1, mode)], res[(2, mode)]
        out[mode] = dict(loss=abs(l1 - l2) / abs(l1), logp=max(rel(a, b) for a, b in zip(lp2, lp1)),
                         grad=max(rel(g2[k], g1[k]) for k in g1))
    return out


def test_tp2_equals_tp1_both_modes():
    for rank_out in run_ranks(_worker, 2, timeout_s=600):
        for mode, r in rank_out.items():
            print(f"TP=2 vs TP=1 {mode}: loss {r['loss']:.1e}, logp {r['logp']:.1e}, worst grad {r['grad']:.1e}")
            assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10, (mode, r)
