"""Context parallelism beyond the Gated DeltaNet head count (parallel/cp_gdn.py: sequence pieces and
an affine scan over the ranks) equals one rank and transformers (float64, gloo).

The model has 2 GDN key heads (4 value heads) and 2 KV heads, so CP=4, TP=2 x CP=2 and CP=8 cannot
shard GDN by heads (parallel.cp.gdn_by_heads is false for all three) and take the sequence path; DP=2 x
CP=2 takes it by model.gdn_cp=sequence where the heads would split. TP=2 x CP=2 once more with one KV
head: KV groups together with CP (parallel/kv_group.py group_cp_attention: each KV head's state
sharded over its KV group x the CP ranks, a quarter of the positions per rank).
Checked against the same groups on one rank: per-group loss, per-token log-probs and every parameter
gradient (through DDP + finalize_model_grads) <= 1e-10, detached and exact mode (exact = the full-
sequence gradient, which the sweep carries through the replicated chunk states), prompts cut into
chunks whose pieces are uneven, shorter than the conv window and empty (T < 2 x CP); the GDN final
state of the capture (whole on every rank) <= 1e-12; and the per-token log-probs against
transformers' Qwen3_5ForCausalLM on the full sequences (float32 upcasts lifted) <= 1e-10."""

from __future__ import annotations

from layout_compare import check_steps, compare, rel

from longstraw_mcore.launch_local import run_ranks


def _step(m, full, groups, tp, cp, mode, chunk_len):
    from layout_compare import replay_groups

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.train.trainer import wrap_ddp

    cfg = RunConfig(model=m, parallel=ParallelConfig(tp=tp, cp=cp), device="cpu", train=TrainConfig())
    par = setup_parallel(cfg)
    model = build_model(m, par, "cpu")
    load_full(model, full)
    steps, grads = replay_groups(model, wrap_ddp(model, cfg, par), par, groups, mode, chunk_len)
    gdn = {}
    if mode == "exact":  # the capture's final GDN states, whole on every rank
        import torch

        from longstraw_mcore.replay.engine import capture

        st = capture(model, torch.tensor([groups[-1].prompt[:-1]]), ReplayConfig(chunk_len=chunk_len))
        gdn = {n: (layer.current.conv, layer.current.recurrent, layer.channels) for n, layer in st.layers.items()
               if hasattr(layer, "current")}
        gdn["tp"] = (par.pgs.tp.rank(), tp)
        # positions of the prompt's K/V this rank keeps, and whether a KV group holds them
        gdn["kv"] = [(layer.k.shape[1], layer.kv is not None) for layer in st.layers.values() if hasattr(layer, "k")]
    return steps, grads, gdn


def _flops(m, full, group, cp, chunk_len):
    """FlopCounterMode's count on this rank (summed over the ranks in _check) of a capture and of exact
    mode's sweep (its prompt_backward steps), with the planner's counts (planner/flops_hybrid.py: Gated
    DeltaNet by sequence pieces, summed over CP)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import LAYERS, build_model
    from longstraw_mcore.ops.dispatch import override
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.flops import step_flops
    from longstraw_mcore.replay.engine import capture
    from longstraw_mcore.replay.group_step import process_group

    model = build_model(m, setup_parallel(RunConfig(model=m, parallel=ParallelConfig(cp=cp), device="cpu")), "cpu")
    load_full(model, full)

    class Sweep:  # a replay/watch.py Watch that counts the FLOPs of the prompt_backward steps
        sweep, at, label = 0, 0, ""

        def begin(self, plan, responses):
            pass

        def before(self, step):
            self.at = fc.get_total_flops()

        def done(self, step, *a, **k):
            if step.phase == "prompt_backward":
                self.sweep += fc.get_total_flops() - self.at

    # the model counts the plain twin's attention (whole key blocks); FlopCounterMode has no formula for
    # torch's fused CPU attention op, which ops.attention=auto takes on CPU
    with override(attention="plain"):
        with FlopCounterMode(display=False) as fc:
            capture(model, torch.tensor([group.prompt[:-1]]), ReplayConfig(chunk_len=chunk_len))
        measured = {"capture": fc.get_total_flops()}
        watch = Sweep()
        with FlopCounterMode(display=False) as fc:
            process_group(model, group, ReplayConfig(mode="exact", chunk_len=chunk_len), GRPOConfig(), watch=watch)
    an = step_flops(LAYERS, m, len(group.prompt), [len(r) for r in group.responses], "exact", chunk_len, 1,
                    cp=cp)["algorithm"]
    return {"capture": (measured["capture"], an["capture"]), "sweep": (watch.sweep, an["prompt_backward"])}


def _hf_logprobs(hf_model, group):
    import torch
    from hf_reference import LiftFloat32ToFloat64

    out = []
    with LiftFloat32ToFloat64(), torch.no_grad():
        for resp in group.responses:
            ids = torch.tensor([group.prompt + resp])
            logp = torch.log_softmax(hf_model(ids).logits[0, :-1].double(), -1)
            out.append(logp[len(group.prompt) - 1:].gather(-1, ids[0, len(group.prompt):, None])[:, 0].tolist())
    return out


def _worker(rank, world_size, layouts, chunk_len):
    import dataclasses
    import os
    import sys

    import torch

    from hf_reference import LiftFloat32ToFloat64, build_hf_model, hf_state, tiny_model_config

    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.parallel.cp import gdn_by_heads

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from test_replay_equivalence import make_group

    models = {}  # KV heads -> (config, transformers' model, its weights, the groups)
    for kv_heads in sorted({lay[4] for lay in layouts}):
        m = tiny_model_config(num_key_value_heads=kv_heads)
        assert m.linear_num_key_heads == 2
        with LiftFloat32ToFloat64():
            hf_model = build_hf_model(m, seed=64)
        models[kv_heads] = (m, hf_model, hf_to_mcore(hf_state(hf_model), m),
                            [make_group(m, 27, [5], seed=61), make_group(m, 31, [3, 1, 7, 2, 6, 1, 4, 8], seed=62)])
    out = {"steps": {}, "gdn": {}, "hf": {}, "kv": {}, "flops": {}}
    hf_lp = {}  # KV heads -> transformers' log-probs of the groups (the same for every layout of that model)
    for mode in ("detached", "exact"):
        refs = {h: _step(m, full, groups, 1, 1, mode, chunk_len) for h, (m, _, full, groups) in models.items()}
        for name, tp, cp, choice, kv_heads in layouts:
            m, hf_model, full, groups = models[kv_heads]
            ref = refs[kv_heads]
            ml = dataclasses.replace(m, gdn_cp=choice)
            assert not gdn_by_heads(m.linear_num_key_heads // tp, cp, choice), name
            assert (tp > kv_heads) == name.startswith("kv groups"), name
            got = _step(ml, full, groups, tp, cp, mode, chunk_len)
            out["steps"][(name, mode)] = compare(ref[:2], got[:2])
            if mode == "exact":  # this TP rank's heads of the one-rank state (conv channels q | k | v)
                r, n_tp = got[2].pop("tp")
                ref[2].pop("tp", None)
                ref[2].pop("kv", None)
                # the state's positions this rank keeps (summed over the ranks in _check)
                kv = got[2].pop("kv")
                assert {grouped for _, grouped in kv} == {tp > kv_heads} and len({rows for rows, _ in kv}) == 1, kv
                out["kv"][name] = (kv[0][0], len(groups[-1].prompt) - 1, cp * (tp if tp > kv_heads else 1))
                worst = 0.0
                for n, (conv, rec, channels) in got[2].items():
                    full_conv, full_rec = ref[2][n][:2]
                    parts = torch.split(full_conv, [c * n_tp for c in channels], 1)
                    want_conv = torch.cat([x.chunk(n_tp, 1)[r] for x in parts], 1)
                    worst = max(worst, rel(conv, want_conv), rel(rec, full_rec.chunk(n_tp, 1)[r]))
                out["gdn"][name] = worst
                if kv_heads not in hf_lp:
                    hf_lp[kv_heads] = [_hf_logprobs(hf_model, g) for g in groups]
                hf = hf_lp[kv_heads]
                out["hf"][name] = max(abs(x - y) for (_, lp), h in zip(got[0], hf)
                                      for a, b in zip(lp, h) for x, y in zip(a, b))
            if mode == "exact" and name == "cp4":  # the planner's FLOPs of the sequence path
                out["flops"] = _flops(ml, full, groups[-1], cp, chunk_len)
    return out


def _check(outs):
    if outs[0]["flops"]:
        for phase in ("capture", "sweep"):
            measured = sum(out["flops"][phase][0] for out in outs)
            model = outs[0]["flops"][phase][1]
            print(f"planner FLOPs of the {phase} by sequence pieces / FlopCounterMode's: {model / measured:.4f}")
            assert model == measured, (phase, model, measured)
    for name, (_, positions, shards) in outs[0]["kv"].items():
        # every rank keeps 1/cp of the prompt's positions, and of those 1/r in a KV group of r = tp ranks:
        # over the world, each position (per KV head a rank serves) is kept world / shards times
        total = sum(out["kv"][name][0] for out in outs)
        assert total * shards == positions * len(outs), (name, total, shards, positions)
    for rank, out in enumerate(outs):
        check_steps(out["steps"], rank, "GDN by sequence ")
        for name in out["gdn"]:
            if rank == 0:
                print(f"{name}: capture's GDN final state vs one rank {out['gdn'][name]:.1e}; log-probs vs "
                      f"transformers {out['hf'][name]:.1e}")
            assert out["gdn"][name] <= 1e-12 and out["hf"][name] <= 1e-10, (name, out["gdn"][name], out["hf"][name])


def test_gdn_by_sequence_cp4_and_tp2cp2_equal_one_rank_and_transformers():
    # chunks of 7 over 8 pieces: pieces of 0 or 1 tokens (shorter than the conv window of 3)
    # and model.gdn_cp=sequence where the heads would split (DP=2 x CP=2)
    # and KV groups with CP: TP=2 x CP=2 with one KV head
    _check(run_ranks(_worker, 4, [("cp4", 1, 4, "auto", 2), ("tp2cp2", 2, 2, "auto", 2),
                                  ("dp2cp2 sequence", 1, 2, "sequence", 2), ("kv groups tp2cp2", 2, 2, "auto", 1)],
                     7, timeout_s=1200))


def test_gdn_by_sequence_cp8_equals_one_rank_and_transformers():
    _check(run_ranks(_worker, 8, [("cp8", 1, 8, "auto", 2)], 20, timeout_s=1800))
