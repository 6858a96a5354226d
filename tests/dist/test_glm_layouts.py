"""GLM-5.x branch replay does not depend on the parallel layout (float64, gloo, 2 / 4 / 8 ranks).

The tiny config of tests/reference/test_glm_parity.py (4 layers: full, full, shared, full indexer;
layer 0 dense, 1-3 MoE with 6 experts, top-k 4 keys: the sparse regime) with transformers' weights.
Against the same groups at tp = pp = cp = ep = 1 (data parallel over the same ranks, through Megatron
DDP + finalize_model_grads, gathered): per-group loss, per-token log-probs and every parameter
gradient <= 1e-10, detached and exact modes, two G=8 groups with unequal branch lengths (1 to 8,
different in the two groups), capture chunks of 5. The layouts score the indexer's keys 3 at a time
with a running top-k, the reference in one pass.
  2 ranks: CP=2 (state sharded by sequence, global top-k, log-sum-exp merge), TP=2 (heads split, the
           state striped by sequence over the TP group; the MoE layer's tokens split by sequence too), EP=2 x DP=2 (3 experts per rank,
           alltoall dispatcher, each rank its own group), PP=2 with stages [1, 3]
  4 ranks: TP2 x EP2
  8 ranks: TP2 x CP2 x EP2, PP2 x CP2 x EP2
EP ranks whose steps differ (a different number of capture chunks) are refused before any model work.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from layout_compare import check_steps, compare, replay_groups

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))


def _build(m, tp: int = 1, ep: int = 1, pp: int = 1, pp_layers=None, cp: int = 1):
    """This rank's model of `m` at the layout (through RunConfig and setup_parallel, as the CLI builds
    it), wrapped in Megatron DDP."""
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.train.trainer import wrap_ddp

    cfg = RunConfig(model=m, parallel=ParallelConfig(tp=tp, ep=ep, pp=pp, pp_layers=pp_layers, cp=cp), device="cpu")
    par = setup_parallel(cfg)
    model = get_family(m.family).build_model(m, par, "cpu")
    return model, wrap_ddp(model, cfg, par), par


def _steps(m, full, groups, **layout):
    from longstraw_mcore.checkpoint.full_state import load_full

    model, ddp, par = _build(m, **layout)
    load_full(model, full)
    return {mode: replay_groups(model, ddp, par, groups, mode) for mode in ("detached", "exact")}


def _compare_layouts(layouts, groups_of) -> dict:
    """{(layout name, mode): differences} of each layout against one rank; `layouts`: (name, first dense
    layers, layout kwargs)."""
    from test_glm_parity import _configs, _hf_model

    from longstraw_mcore.checkpoint.glm_dsa import from_transformers_state, hf_to_mcore

    out, refs = {}, {}
    for name, first_dense, layout in layouts:
        hf_cfg, m = _configs(4, first_dense)
        full = hf_to_mcore(from_transformers_state(_hf_model(hf_cfg, 5).state_dict()), m)
        groups = groups_of(m)
        if first_dense not in refs:  # one reference per model variant, shared by its layouts
            refs[first_dense] = _steps(m, full, groups)
        ref = refs[first_dense]
        # the layout scores keys 3 at a time with a running top-k; the reference in one pass
        got = _steps(dataclasses.replace(m, index_block=3), full, groups, **layout)
        for mode in got:
            out[(name, mode)] = compare(ref[mode], got[mode])
    return out


def _two_groups(m):
    """Two G=8 groups with the same steps (prompt length, G) but different branch lengths: the EP ranks'
    all-to-alls run in lockstep with different token counts (replay/engine.py refuses other steps)."""
    from test_replay_equivalence import make_group

    return [make_group(m, 16, [3, 1, 7, 2, 6, 1, 4, 8], seed=81), make_group(m, 16, [5, 8, 1, 2, 7, 3, 1, 6], seed=82)]


def _worker(rank, world_size):
    from test_replay_equivalence import make_group

    # PP=2 splits [1, 3]: the second stage starts at a full indexer layer (layer types full, full, shared, full)
    out = _compare_layouts([("cp2", 1, dict(cp=2)), ("tp2", 1, dict(tp=2)), ("ep2 x dp2", 1, dict(ep=2)),
                            ("pp2 [1, 3]", 1, dict(pp=2, pp_layers=[1, 3]))], _two_groups)
    # different numbers of capture chunks on the two EP ranks: refused before any model work (no hang)
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.replay.group_step import process_group

    from test_glm_parity import _configs

    m = _configs(4, 1)[1]
    model, ddp, par = _build(m, ep=2)
    g = make_group(m, 16 + 2 * par.pgs.dp.rank(), [3, 1], seed=90)
    try:
        process_group(ddp, g, ReplayConfig(chunk_len=5), GRPOConfig())
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    return out


def _worker4(rank, world_size):
    return _compare_layouts([("tp2 x ep2", 1, dict(tp=2, ep=2))], _two_groups)


def _worker8(rank, world_size):
    return _compare_layouts([("tp2 x cp2 x ep2", 1, dict(tp=2, cp=2, ep=2)),
                             ("pp2 [1, 3] x cp2 x ep2", 1, dict(pp=2, pp_layers=[1, 3], cp=2, ep=2))], _two_groups)


def test_glm_tp2_cp2_ep2_and_pp2_cp2_ep2_on_8_ranks_equal_single_rank():
    for rank, out in enumerate(run_ranks(_worker8, 8, timeout_s=1200)):
        check_steps(out, rank, prefix="GLM ")


def test_glm_tp2_ep2_on_4_ranks_equal_single_rank():
    for rank, out in enumerate(run_ranks(_worker4, 4, timeout_s=900)):
        check_steps(out, rank, prefix="GLM ")


def test_glm_tp2_ep2_pp2_equal_single_rank():
    for rank, out in enumerate(run_ranks(_worker, 2, timeout_s=900)):
        assert "expert-parallel ranks run different replay schedules" in out.pop("refused")
        check_steps(out, rank, prefix="GLM ")
