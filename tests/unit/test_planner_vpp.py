"""The planner's pipeline schedules (planner/timing.py) against Megatron-Core's own accounting.

- The micro-batches the interleaved schedule holds in flight on each pipeline rank: Megatron's warm-up
  count (`get_pp_rank_microbatches`, the function its interleaved schedule calls) plus one, in chunks of
  1/vpp of a stage, equals the planner's `in_flight`, for pp 2, 4, 8, vpp 2, 4 and 1 to 40 micro-batches;
  the replay's padding (replay/plan.py `interleaved_padding`) gives Megatron a multiple of pp and a steady
  state on every rank (no rank all warm-up: measured to hang at pp=2, tests/dist/test_vpp_replay.py's G=1
  group); at vpp = 1 the count is 1F1B's min(pp - s, micro-batches).
- `longstraw plan` at parallel.vpp=2 and 4: the bubble falls as (pp - 1) / (vpp k + pp - 1) of a schedule of k
  micro-batches, the plan's seconds with it, and the activations grow (more micro-batches in flight).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from test_planner import _plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_in_flight_and_padding_follow_megatrons_interleaved_schedule():
    from hf_reference import tiny_model_config
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.planner.timing import in_flight
    from longstraw_mcore.replay.plan import interleaved_padding

    checked = 0
    for pp in (2, 4, 8):
        for vpp in (1, 2, 4):
            m = tiny_model_config(num_layers=pp * vpp)
            for micro in range(1, 41):
                # micro replay micro-steps of one branch each, no capture chunk in detached mode
                cfg = RunConfig(model=m, parallel=ParallelConfig(pp=pp, vpp=vpp), device="cpu",
                                replay=ReplayConfig(mode="detached", batch_tokens=0))
                n = micro + interleaved_padding(micro, pp, vpp, forward_only=False)
                assert n % pp == 0 or vpp == 1
                for s in range(pp):
                    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda pp=pp: pp, rank=lambda s=s: s),
                                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
                    total, all_warm, warm, _ = get_pp_rank_microbatches(n, vpp, pp, p2p_communicator=comm)
                    stage = range(s * vpp, (s + 1) * vpp)  # (the planner's contiguous count per rank)
                    got = in_flight(cfg, 2, 4, micro, stage)
                    if vpp == 1:
                        assert got == min(pp - s, micro), (pp, micro, s, got)
                    else:
                        assert not all_warm, (pp, vpp, micro, s)  # a steady state on every rank
                        assert got == -(-min(warm + 1, total) // vpp), (pp, vpp, micro, s, got, warm)
                    checked += 1
    assert checked == 40 * (2 + 4 + 8) * 3


def test_plan_bubble_falls_with_vpp_and_activations_grow():
    q27 = os.path.join(ROOT, "configs/qwen3.6-27b.yaml")
    res = {}
    for vpp in (1, 2, 4):
        rc, out, err = _plan_cli("--config", q27, "--prompt-len", "262144", "--response-len", "1024", "--group-size",
                                 "8", "--gpus", "8", "--json", "parallel.tp=2", "parallel.pp=4", f"parallel.vpp={vpp}",
                                 "replay.mode=exact")
        assert rc == 0, err
        res[vpp] = json.loads(out)
    k = res[1]["bubble"]["micro_batches"]["replay"]
    assert k == 1 + 262143 // 4096 + 1  # one replay micro-step, the sweep's 64 chunks (replay.chunk_len 4096)
    for vpp, r in res.items():
        b = r["bubble"]
        assert b["schedule"] == ("1F1B" if vpp == 1 else f"interleaved, vpp={vpp}")
        assert abs(b["idle_fraction"]["replay"] - 3 / (vpp * k + 3)) < 1e-12
        assert r["inputs"]["layout"].get("vpp", 1) == vpp
    assert res[4]["seconds"]["total"] < res[2]["seconds"]["total"] < res[1]["seconds"]["total"]
    act = {v: r["per_rank_bytes"]["activations"] for v, r in res.items()}
    assert act[2] > act[1] and act[4] > act[1], act


def test_suggest_searches_vpp_where_train_runs_it():
    from longstraw_mcore.config import config_to_dict, load_config
    from longstraw_mcore.planner.suggest import layouts

    base = config_to_dict(load_config(os.path.join(ROOT, "configs/qwen3.6-27b.yaml")))
    got = [(ov, cfg) for ov, cfg in layouts(base, 8, 64) if cfg.parallel.tp == 2 and cfg.parallel.cp == 1
           and cfg.parallel.pp == 4]
    assert sorted(cfg.parallel.vpp for _, cfg in got) == [1, 2, 4], [ov for ov, _ in got]
    assert all(("parallel.vpp=" in " ".join(ov)) == (cfg.parallel.vpp > 1) for ov, cfg in got)
    # Megatron's distributed optimizer is not run on interleaved stages yet: RunConfig refuses, the search skips
    dist_opt = dict(base, train=dict(base["train"], distributed_optimizer=True))
    assert {cfg.parallel.vpp for _, cfg in layouts(dist_opt, 8, 64)} == {1}
