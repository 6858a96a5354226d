"""Pipeline-parallel branch replay equals a single rank (float64, gloo).

Why the result must not depend on the stage split: each stage keeps its own layers' state and runs
the same plan (replay/stages.py); the hidden states and their gradients cross stages unchanged
(Megatron's p2p), the last stage computes the log-probs and the losses, and exact mode's reverse
sweep injects every stage's state gradient when the backward reaches that stage's output, read only
after every branch and every later chunk has deposited into it on that stage.

Checked, against the same groups on one rank, through Megatron DDP + finalize_model_grads: per-group
loss, per-token log-probs and every parameter gradient (gathered) <= 1e-10 relative, both modes, a
G=1 group and a G=8 group with unequal branch lengths (1 to 8) in replay micro-steps of 3, 4 and 1
branches (replay.batch_tokens=24: micro-batches of different sizes through the 1F1B schedule; one
rank's result does not depend on the budget, tests/replay/test_replay_equivalence.py), capture chunks
of 7 (the last one short); scoring without autograd (forward-only schedules) gives the same log-probs. The 4-layer model alternates Gated DeltaNet and attention: PP=2 gives each stage both
kinds, PP=4 and the uneven split pp_layers=[1, 3] give stages with one kind only. Layouts: PP=2
(2 ranks); PP=4, pp_layers=[1,3] x DP=2, TP=2 x PP=2, PP=2 x CP=2 (4 ranks); TP=2 x PP=2 x CP=2
(8 ranks); at PP=2 x CP=2 also exact mode with gradients reduce-scattered into DP x CP shards after
every micro-step (train/zero2.py; no full gradient outlives a micro-step). Memory: on each stage of PP=2 the peak of an exact-mode group step grows from G=2 to
G=8 by less than one branch's scratch (1F1B keeps at most pp - s micro-batches in flight on stage
s whatever G is; the G=2 schedule already has that many).
"""

from __future__ import annotations

import torch
from layout_compare import check_steps, compare

from longstraw_mcore.launch_local import run_ranks


def _model_cfg():
    from hf_reference import tiny_model_config

    return tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)


def _groups(m):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from test_replay_equivalence import make_group

    return [make_group(m, 27, [5], seed=71), make_group(m, 31, [3, 1, 7, 2, 6, 1, 4, 8], seed=72)]


BUDGET = 24
"""replay.batch_tokens: the G=8 group's branches of 3, 1, 7, 2, 6, 1, 4, 8 tokens in micro-steps of 3, 4, 1."""


def _setup(m, full, tp, pp, cp, pp_layers=None):
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import ParallelConfig, RunConfig, TrainConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.train.trainer import wrap_ddp

    cfg = RunConfig(model=m, parallel=ParallelConfig(tp=tp, pp=pp, cp=cp, pp_layers=pp_layers), device="cpu",
                    train=TrainConfig())
    par = setup_parallel(cfg)
    model = build_model(m, par, "cpu")
    load_full(model, full)
    return model, wrap_ddp(model, cfg, par), par


def _steps(m, full, groups, layout, zero2=False):
    """A validate-like step per mode on one model: per-group (loss, log-probs) on every rank, the full
    gradients, and (pipeline rank, layers on this stage)."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.checkpoint.full_state import gather_full
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.replay.group_step import process_group

    model, ddp, par = _setup(m, full, *layout)
    n, dp_rank = len(groups), par.pgs.dp.rank()
    out = {}
    for mode in ("detached", "exact"):
        ddp.zero_grad_buffer()
        mine = {}
        for i in range(n):
            if i % par.dp == dp_rank:
                st = process_group(ddp, groups[i], ReplayConfig(mode=mode, chunk_len=7, batch_tokens=BUDGET),
                                   GRPOConfig(beta=0.05), scale=par.dp / n)
                mine[i] = (st.loss, st.logprobs)
        finalize_model_grads([ddp], pg_collection=par.pgs)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        merged = {k: v for d in every for k, v in d.items()}
        out[mode] = ([merged[i] for i in range(n)], gather_full(model, grads=True),
                     (par.pp_rank, len(model.decoder.layers)))
    if zero2:
        out["exact, micro-step shards"] = _sharded(m, full, par, groups)
    from longstraw_mcore.replay.engine import score_group

    # scoring without autograd (DPO's policy and reference log-probs): forward-only schedules
    out["scores"] = [lp.tolist() for lp in score_group(ddp, groups[1].prompt, groups[1].responses,
                                                       ReplayConfig(chunk_len=7, batch_tokens=BUDGET))[0]]
    return out


def _sharded(m, full, par, groups):
    """Exact mode with gradients reduce-scattered into DP x CP shards after every micro-step
    (train/zero2.py), which the pipeline triggers at the end of each micro-batch's backward on each
    stage; the shards gathered back into full gradients. Also: no full `.grad` survives a group."""
    import torch.distributed as dist

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.zero2 import ShardedGradients

    model = build_model(m, par, "cpu")  # no DDP: its hooks would take the gradients first
    load_full(model, full)
    grads = ShardedGradients(model, par.pgs.dp_cp, par)
    n, dp_rank, held = len(groups), par.pgs.dp.rank(), 0
    mine = {}
    for i in range(n):
        if i % par.dp == dp_rank:
            st = process_group(grads, groups[i], ReplayConfig(mode="exact", chunk_len=7, batch_tokens=BUDGET),
                               GRPOConfig(beta=0.05), scale=par.dp / n)
            mine[i] = (st.loss, st.logprobs)
            held += sum(p.grad is not None for p in model.parameters())
    grads.finish()
    assert held == 0, f"{held} full parameter gradients outlived their micro-step"
    for p in model.parameters():
        shard = grads.grad[p]
        parts = torch.empty(shard.numel() * grads.n, dtype=shard.dtype)
        dist.all_gather_into_tensor(parts, shard, group=grads.group)
        p.grad = parts[:p.numel()].view_as(p).clone()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {k: v for d in every for k, v in d.items()}
    return [merged[i] for i in range(n)], gather_full(model, grads=True), (par.pp_rank, len(model.decoder.layers))


def _memory(m, full):
    """PP=2: this stage's peak of an exact-mode group step at G=2 and G=8, and one branch's scratch."""
    from group_peaks import group_peaks

    model, _, par = _setup(m, full, 1, 2, 1)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, m.vocab_size, (257,), generator=gen).tolist()
    return dict(group_peaks(model, m, par.device, prompt, gen), stage=par.pp_rank)


def _cli(tmp, name, overrides):
    """`longstraw train` (2 exact-mode steps, a checkpoint) then `longstraw validate --load` of that
    checkpoint, in this layout: the CLI's entry point on these ranks (as torchrun would start it)."""
    import json
    import os

    from longstraw_mcore.cli import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    d = os.path.join(tmp, name)
    base = ["--config", os.path.join(root, "configs/qwen3.6-tiny.yaml"), "--rollouts", os.path.join(tmp, "r.jsonl")]
    rc_train = main(["train", *base, "--steps", "2", "--save", f"{d}/ckpt", "--metrics-out", f"{d}/m.jsonl",
                     *overrides, "replay.mode=exact", "replay.chunk_len=16", "train.save_every=2"])
    rc_val = main(["validate", *base, "--load", f"{d}/ckpt/step_000002", "--out", f"{d}/val", "--mode", "exact",
                   *overrides, "replay.chunk_len=16"])
    if rank_is_zero():
        metrics = [json.loads(x) for x in open(f"{d}/m.jsonl")]
        receipt = json.loads(open(f"{d}/val/receipt.json").read())
        return dict(rc=(rc_train, rc_val), steps=[m["step"] for m in metrics], losses=[m["loss"] for m in metrics],
                    layout=receipt["layout"], val_loss=receipt["loss"], grad_norm=receipt["grad_norm"])
    return dict(rc=(rc_train, rc_val))


def rank_is_zero() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def _worker(rank, world_size, layouts, memory=False, cli=None):
    from hf_reference import build_hf_model, hf_state

    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore

    m = _model_cfg()
    full = hf_to_mcore(hf_state(build_hf_model(m, seed=74)), m)
    groups = _groups(m)
    out = {"steps": {}, "scores": {}}
    ref = _steps(m, full, groups, (1, 1, 1))
    for name, *layout in layouts:
        zero2 = name.endswith("+zero2")
        got = _steps(m, full, groups, layout[:4], zero2)
        for mode in got:
            if mode != "scores":
                out["steps"][(name, mode)] = dict(compare(ref[mode.split(",")[0]], got[mode]), stage=got[mode][2])
        out["scores"][name] = max(abs(x - y) for a, b in zip(got["scores"], ref["scores"]) for x, y in zip(a, b))
    if memory:
        out["memory"] = _memory(m, full)
    if cli is not None:
        tmp, runs = cli
        out["cli"] = {name: (_cli(tmp, name, overrides), want) for name, overrides, want in runs}
    return out


def _check(outs):
    for rank, out in enumerate(outs):
        check_steps(out["steps"], rank)
        for (name, mode), r in out["steps"].items():
            if "[1,3]" in name:  # the uneven split really is one layer, then three
                assert r["stage"][1] == (1, 3)[r["stage"][0]], r
        for name, d in out["scores"].items():
            if rank == 0:
                print(f"{name} scoring (no autograd): logp {d:.1e}")
            assert d <= 1e-10, (name, d)
        for name, (r, want) in out.get("cli", {}).items():
            assert r["rc"] == (0, 0), (name, r)
            if rank == 0:
                print(f"CLI {name}: train losses {r['losses']}, validate loss {r['val_loss']:.6g}, grad norm "
                      f"{r['grad_norm']:.6g}, layout {r['layout']}")
                assert r["steps"] == [1, 2] and all(x == x for x in r["losses"]), (name, r)
                assert {k: r["layout"][k] for k in want} == want and r["grad_norm"] > 0, (name, r)


def _rollouts(tmp_path) -> str:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    from make_rollouts import make_groups

    from longstraw_mcore.data.rollouts import write_rollouts

    write_rollouts(tmp_path / "r.jsonl", make_groups(512, 4, 30, 2, 6, seed=5, equal_reward_every=0))
    return str(tmp_path)


def test_pp2_equals_single_rank_and_memory():
    outs = run_ranks(_worker, 2, [("pp2", 1, 2, 1)], True, timeout_s=900)
    _check(outs)
    for out in outs:
        mem = out["memory"]
        print(f"PP=2 stage {mem['stage']}: exact group-step peak G=2 {mem['peaks'][2]} B, G=8 {mem['peaks'][8]} B, "
              f"one branch's scratch {mem['scratch']} B")
        assert mem["peaks"][8] - mem["peaks"][2] <= mem["scratch"], mem


GDN8 = ["model.linear_num_key_heads=4", "model.linear_num_value_heads=8"]  # GDN heads split over tp x cp = 4


def test_pp4_uneven_tp2pp2_pp2cp2_equal_single_rank_and_cli(tmp_path):
    cli = (_rollouts(tmp_path), [
        ("pp4", ["parallel.pp=4"], {"pp": 4}),
        ("tp2pp2", ["parallel.tp=2", "parallel.pp=2"], {"tp": 2, "pp": 2}),
        # gradients reduce-scattered into DP x CP shards after every micro-step, under PP
        ("pp2cp2_micro_step", ["parallel.pp=2", "parallel.cp=2", "train.grad_reduction=micro_step", *GDN8],
         {"pp": 2, "cp": 2})])
    _check(run_ranks(_worker, 4, [("pp4", 1, 4, 1), ("pp2[1,3]dp2", 1, 2, 1, [1, 3]), ("tp2pp2", 2, 2, 1),
                                  ("pp2cp2+zero2", 1, 2, 2)], False, cli, timeout_s=1500))


def test_tp2pp2cp2_equals_single_rank_and_cli(tmp_path):
    cli = (_rollouts(tmp_path), [("tp2pp2cp2", ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2", *GDN8],
                                  {"tp": 2, "pp": 2, "cp": 2})])
    _check(run_ranks(_worker, 8, [("tp2pp2cp2", 2, 2, 2)], False, cli, timeout_s=1500))
