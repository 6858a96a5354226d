"""GLM-5.3-Flash branch replay does not depend on the parallel layout (float64, gloo, 2 and 4 ranks).

The tiny config of tests/reference/test_glm5_next_parity.py (KDA / MLA full / MLA shared / KDA, 2 KDA heads, dense
then MoE of 4 experts, 4 residual streams, index_topk 4 in pools of 4: sparse) with transformers' weights, against
the same groups at one rank (data parallel over the same ranks, through Megatron DDP + finalize_model_grads,
gathered): per-group loss, per-token log-probs and every parameter gradient <= 1e-10, detached and exact modes,
two G=8 groups with unequal branch lengths and a prompt of 18 (capture chunks of 5: chunk and prompt ends inside
pools). The layouts score the pools 3 at a time with a running top-k, the reference in one pass.
  2 ranks: CP=2 with KDA by heads (a head per rank), CP=2 with KDA by sequence pieces (model.gdn_cp=sequence),
           TP=2 (a KDA head per rank; the MLA latent striped), EP=2 x DP=2, PP=2 with stages [1, 3] (the streams,
           4 x hidden wide, cross the stage boundary)
  4 ranks: TP=2 x CP=2 (one KDA head per TP rank: CP beyond the heads, by sequence pieces)
"""

from __future__ import annotations

import dataclasses
import os
import sys

from layout_compare import check_steps, compare, replay_groups

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))


def _groups(m):
    from test_replay_equivalence import make_group

    return [make_group(m, 18, [3, 1, 7, 2, 6, 1, 4, 8], seed=81), make_group(m, 18, [5, 8, 1, 2, 7, 3, 1, 6], seed=82)]


def _compare(layouts) -> dict:
    from test_glm5_next_parity import _configs, _hf_model
    from test_glm_layouts import _steps

    from longstraw_mcore.checkpoint.glm5_next import from_transformers_state, hf_to_mcore

    hf_mod, cfg, m = _configs(4)
    full = hf_to_mcore(from_transformers_state(_hf_model(hf_mod, cfg, 5).state_dict()), m)
    groups = _groups(m)
    ref = _steps(m, full, groups)
    out = {}
    for name, model_kw, layout in layouts:
        got = _steps(dataclasses.replace(m, index_block=3, **model_kw), full, groups, **layout)
        for mode in got:
            out[(name, mode)] = compare(ref[mode], got[mode])
    return out


def _worker2(rank, world_size):
    return _compare([("cp2 (KDA by heads)", dict(gdn_cp="heads"), dict(cp=2)),
                     ("cp2 (KDA by sequence)", dict(gdn_cp="sequence"), dict(cp=2)),
                     ("tp2", {}, dict(tp=2)), ("ep2 x dp2", {}, dict(ep=2)),
                     ("pp2 [1, 3]", {}, dict(pp=2, pp_layers=[1, 3]))])


def _worker4(rank, world_size):
    return _compare([("tp2 x cp2", {}, dict(tp=2, cp=2))])


def test_glm5_next_cp2_tp2_ep2_pp2_equal_single_rank():
    for rank, out in enumerate(run_ranks(_worker2, 2, timeout_s=900)):
        check_steps(out, rank, prefix="GLM-5.3 ")


def test_glm5_next_tp2_cp2_equal_single_rank():
    for rank, out in enumerate(run_ranks(_worker4, 4, timeout_s=900)):
        check_steps(out, rank, prefix="GLM-5.3 ")
