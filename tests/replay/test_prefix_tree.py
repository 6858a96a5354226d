"""Prefix-tree replay (replay/tree.py) changes no number (float64, gloo).

A group whose responses share segments at three depths, with loss masks zeroing tokens inside shared
and unshared segments and responses ending at a segment's end (tests/tree_groups.py), for both
families (Qwen3.5-style hybrid: attention K/V + Gated DeltaNet state; GLM-5.x: MLA latents + DSA
index keys, top-k 4 of the tiny config; at one rank also GLM-5.3-Flash: KDA state, MLA latents and pooled index
keys, segments ending inside pools):
- one rank: exact mode == each response run as its own full sequence with ordinary autograd
  (replay/reference.py; loss, every per-token log-prob, every gradient <= 1e-10); detached mode == the
  flat replay (every response whole against the detached prompt state, itself checked against
  transformers' cache in tests/replay/test_detached_vs_hf_cache.py); the tree replays the trie's token
  count, counted here from distinct prefixes; scoring without autograd gives the same log-probs;
- layouts against one rank (through Megatron DDP, both modes): Qwen TP=2 x CP=2, GLM TP=2 x CP=2
  (4 ranks); Qwen PP=2, GLM PP=2 with stages [1, 3] (the segments' kept graphs inside Megatron's 1F1B
  schedule: replay/pipeline.py), GLM EP=2 x DP=2, each EP rank its own tree of the same shape, and a
  tree beside a flat group (the EP ranks then replay both flat: replay/engine.py `_tree`) (2 ranks);
- memory: G=16 on a tree of depth 3 against the same group replayed flat.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from layout_compare import check_steps, compare, rel, replay_groups

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))


def _models():
    """(name, model config, full weights) of both families: weights from transformers' models."""
    from hf_reference import build_hf_model, hf_state, tiny_model_config
    from test_glm_parity import _configs, _hf_model

    from longstraw_mcore.checkpoint import glm_dsa, qwen3_5

    qm = tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)
    hf_cfg, gm = _configs(4)
    return [("qwen", qm, qwen3_5.hf_to_mcore(hf_state(build_hf_model(qm, seed=3)), qm)),
            ("glm", gm, glm_dsa.hf_to_mcore(glm_dsa.from_transformers_state(_hf_model(hf_cfg, 5).state_dict()), gm)),
            glm5_next_model()]


def glm5_next_model():
    """("glm5", GLM-5.3-Flash's tiny config (index_topk 4 in pools of 4), its full weights from transformers)."""
    import test_glm5_next_parity as P

    from longstraw_mcore.checkpoint import glm5_next

    hf_mod, cfg, m = P._configs(4)
    state = glm5_next.from_transformers_state(P._hf_model(hf_mod, cfg, 5).state_dict())
    return "glm5", m, glm5_next.hf_to_mcore(state, m)


def _build(m, ddp: bool = True, **layout):
    """This rank's model at the layout (as the CLI builds it) and, with `ddp`, its Megatron DDP wrapper."""
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.train.trainer import wrap_ddp

    cfg = RunConfig(model=m, parallel=ParallelConfig(**layout), device="cpu")
    par = setup_parallel(cfg)
    model = get_family(m.family).build_model(m, par, "cpu")
    return model, (wrap_ddp(model, cfg, par) if ddp else None), par


def _one_rank(rank, world_size):
    from test_replay_equivalence import grads_and_loss
    from tree_groups import trie_tokens, tree_group

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.replay.engine import replayed_tokens, run_group, score_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    out = {}
    gcfg = GRPOConfig(beta=0.05)
    for name, m, full in _models():
        model = _build(m, ddp=False)[0]  # plain .grad: grads_and_loss zeroes and reads them
        load_full(model, full)
        group = tree_group(m, 13, seed=7)
        ref = grads_and_loss(model, group, gcfg, lambda fn: full_sequence_branches(
            model, group.prompt, group.responses, fn))
        for mode in ("exact", "detached"):
            runs = {}
            for tree in (True, False):
                cfg = ReplayConfig(mode=mode, chunk_len=5, prefix_tree=tree)
                runs[tree] = grads_and_loss(model, group, gcfg, lambda fn: [
                    r.logprobs for r in run_group(model, group.prompt, group.responses, fn, cfg)[0]])
            (loss, lp, g), flat = runs[True], runs[False]
            against = ref if mode == "exact" else flat
            out[(name, mode)] = dict(loss=abs(loss - against[0]) / abs(against[0]),
                                     logp=max(rel(a, b) for a, b in zip(lp, against[1])),
                                     grad=max(rel(g[k], against[2][k]) for k in against[2]),
                                     n=len(against[2]), vs_flat=max(rel(g[k], flat[2][k]) for k in flat[2]))
        scored = score_group(model, group.prompt, group.responses, ReplayConfig(chunk_len=5))[0]
        out[(name, "scored")] = max(rel(a, b) for a, b in zip(scored, ref[1]))
        out[(name, "tokens")] = (replayed_tokens(model, group.responses, ReplayConfig()), trie_tokens(group.responses),
                                 sum(len(r) for r in group.responses),
                                 replayed_tokens(model, group.responses, ReplayConfig(prefix_tree=False)))
    return out


def test_tree_equals_full_sequences_and_flat_replay_one_rank():
    out = run_ranks(_one_rank, 1, timeout_s=900)[0]
    for name in ("qwen", "glm", "glm5"):
        replayed, trie, total, flat = out.pop((name, "tokens"))
        print(f"{name}: replayed {replayed} tokens of {total} (trie {trie}; flat replay {flat})")
        assert replayed == trie < total and flat == total
        scored = out.pop((name, "scored"))
        print(f"{name} scored without autograd vs full sequences: logp {scored:.1e}")
        assert scored <= 1e-10
    for (name, mode), r in out.items():
        against = "full sequences" if mode == "exact" else "flat replay"
        print(f"{name} {mode} tree vs {against}: loss {r['loss']:.1e}, logp {r['logp']:.1e}, worst of {r['n']} "
              f"gradients {r['grad']:.1e}")
        assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10, (name, mode, r)
        assert r["vs_flat"] <= 1e-10, (name, mode, r)  # and the flat replay of the same mode (exact: too)


def _layouts(rank, world_size, layouts):
    from tree_groups import tree_group

    from longstraw_mcore.checkpoint.full_state import load_full

    out = {}
    models = {name: (m, full) for name, m, full in _models()}
    for family, name, layout, *mixed in layouts:
        m, full = models[family]
        groups = [tree_group(m, 13, seed=11), tree_group(m, 13, seed=12)]
        if mixed:  # the second group flat (random responses sharing nothing): its EP partner's tree replays flat
            from test_replay_equivalence import make_group

            groups[1] = make_group(m, 13, [3, 1, 7, 2, 6, 1, 4, 8], seed=81)
        runs = []
        for lay in ({}, layout):
            mm = dataclasses.replace(m, index_block=3) if family == "glm" and lay else m
            model, ddp, par = _build(mm, **lay)
            load_full(model, full)
            runs.append({mode: replay_groups(model, ddp, par, groups, mode) for mode in ("detached", "exact")})
        for mode in runs[0]:
            out[(f"{family} {name}", mode)] = compare(runs[0][mode], runs[1][mode])
    return out


def test_tree_tp2_cp2_both_families_equal_single_rank():
    for rank, out in enumerate(run_ranks(_layouts, 4, [("qwen", "tp2 x cp2", dict(tp=2, cp=2)),
                                                       ("glm", "tp2 x cp2", dict(tp=2, cp=2))], timeout_s=1200)):
        check_steps(out, rank, prefix="tree ")


def test_tree_pp2_both_families_and_glm_ep2_equal_single_rank():
    for rank, out in enumerate(run_ranks(_layouts, 2, [("qwen", "pp2", dict(pp=2)),
                                                       ("glm", "pp2 [1, 3]", dict(pp=2, pp_layers=[1, 3])),
                                                       ("glm", "ep2 x dp2", dict(ep=2)),
                                                       ("glm", "ep2 x dp2, a tree beside a flat group", dict(ep=2),
                                                        True)], timeout_s=900)):
        check_steps(out, rank, prefix="tree ")


def _memory(rank, world_size):
    import torch
    from hf_reference import tiny_model_config
    from longstraw_mcore.bench.memory import measure_memory
    from longstraw_mcore.bench.trees import full_tree
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.replay.group_step import process_group

    # one GDN + one gated attention layer, float32 (as tests/replay/test_memory.py)
    m = tiny_model_config(num_layers=2, full_attention_interval=2, vocab_size=256, dtype="float32", gdn_chunk_size=16)
    model, _, par = _build(m, ddp=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, m.vocab_size, (64,), generator=g).tolist()
    widths, lengths = (1, 2, 2, 4), (24, 12, 6, 6)
    grp = RolloutGroup(prompt=prompt, responses=full_tree(m.vocab_size, widths, lengths, g),
                       rewards=[float(i % 3) for i in range(16)])
    out = {}
    for mode in ("detached", "exact"):
        for tree in (True, False):
            # one branch per micro-step, flat and tree alike: the comparison is of the path's states, not
            # of how many tails share a micro-step
            rcfg = ReplayConfig(mode=mode, chunk_len=16, prefix_tree=tree, batch_tokens=0)
            st = process_group(model, grp, rcfg, GRPOConfig())  # warm: parameter gradients exist
            peak = min(measure_memory(lambda: process_group(model, grp, rcfg, GRPOConfig()), par.device)[1]
                       for _ in range(2))
            out[(mode, tree)] = (peak, st.replayed_tokens, st.tokens)
    # the live path's segment states: each segment's K/V and its GDN state (the kinds' analytic bytes)
    kinds = get_family(m.family).layers
    out["path_states"] = sum(sum(analytic_state_bytes(kinds, m, 1, n).values()) for n in lengths[:-1])
    return out


def test_tree_peak_grows_by_at_most_the_live_path_segment_states():
    """G=16 responses of 48 tokens on a tree of depth 3 (a 24-token segment shared by all, two of 12, four
    of 6; 78% of the tokens shared) against the same group replayed flat, one branch per micro-step."""
    out = run_ranks(_memory, 1, timeout_s=600)[0]
    bound = out.pop("path_states")
    for mode in ("detached", "exact"):
        (tree, replayed, total), (flat, flat_replayed, _) = out[(mode, True)], out[(mode, False)]
        print(f"{mode}: peak tree {tree / 2**10:.1f} KiB ({replayed} of {total} tokens replayed), flat "
              f"{flat / 2**10:.1f} KiB ({flat_replayed}); growth {(tree - flat) / 2**10:.1f} KiB, the live path's "
              f"segment states {bound / 2**10:.1f} KiB")
        assert (replayed, flat_replayed) == (24 + 2 * 12 + 4 * 6 + 16 * 6, total)
        assert tree - flat <= bound, (mode, tree, flat, bound)
