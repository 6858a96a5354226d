"""Context parallelism equals a single rank (float64, gloo).

Why the result must not depend on the (dp, cp) split: a CP rank captures and recomputes only its
zig-zag pieces of every chunk and keeps only their K/V; attention over the union of every rank's
keys is one softmax merged by log-sum-exp (exact, any order), and its backward splits by key shard
with the global lse (each state gradient lands on the rank that holds the state, once). A branch is
replayed whole on every CP rank, so its parameter gradients are replicated, while a recomputed
chunk's are partial per rank; the recompute's seeds are scaled by CP (and what it deposits into the
state gradient by 1/CP), and Megatron DDP's average over data x context parallel ranks then gives
replicated + sum of partials: the single-rank gradient. Different prompt groups on the DP ranks are
averaged over DP as without CP.

Checked, against the same groups on one rank: per-group loss, per-token log-probs and every
parameter gradient (gathered, through DDP + finalize_model_grads) <= 1e-10 relative, both modes, a
G=1 group (KL term only) and a G=8 group with unequal branch lengths (1 to 8), prompts whose length
is not divisible by 2 x CP, capture chunks of 7 (the last one short); layouts CP=2 (2 ranks) and
CP=4, TP=2 x CP=2, DP=2 x CP=2 (4 ranks). Capture: each rank's K/V placed at their prompt positions
equal the single-rank state (<= 1e-12), the GDN final state too, and per-rank K/V bytes sum to the
single-rank bytes (exactly half per rank at CP=2 when chunks are divisible by 2 x CP). Memory: the
peak of an exact-mode group step at CP=2 grows from G=2 to G=8 by less than one branch's scratch
(CPU allocator totals; gloo frees a few collective buffers asynchronously, hence the tolerance). PP x CP: tests/dist/test_pipeline.py. Not covered: CUDA/NCCL.
"""

from __future__ import annotations

import torch
from layout_compare import check_steps, compare, rel

from longstraw_mcore.launch_local import run_ranks


def _model_cfg():
    from hf_reference import tiny_model_config

    return tiny_model_config(linear_num_key_heads=4, linear_num_value_heads=8)


def _groups(m):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "replay"))
    from test_replay_equivalence import make_group

    return [make_group(m, 27, [5], seed=61), make_group(m, 31, [3, 1, 7, 2, 6, 1, 4, 8], seed=62)]


def _step(m, full, groups, tp, cp, mode):
    """One validate-like step through Megatron DDP: per-group (loss, log-probs) and full gradients."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import wrap_ddp

    cfg = RunConfig(model=m, parallel=ParallelConfig(tp=tp, cp=cp), device="cpu", train=TrainConfig())
    par = setup_parallel(cfg)
    model = build_model(m, par, "cpu")
    load_full(model, full)
    ddp = wrap_ddp(model, cfg, par)
    ddp.zero_grad_buffer()
    n, dp_rank = len(groups), par.pgs.dp.rank()
    mine = {}
    for i in range(n):
        if i % par.dp == dp_rank:
            st = process_group(ddp, groups[i], ReplayConfig(mode=mode, chunk_len=7), GRPOConfig(beta=0.05),
                               scale=par.dp / n)
            mine[i] = (st.loss, st.logprobs)
    finalize_model_grads([ddp], pg_collection=par.pgs)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {k: v for d in every for k, v in d.items()}
    return [merged[i] for i in range(n)], gather_full(model, grads=True), par


def _captured(m, full, prompt, tp, cp, mode):
    """Every attention layer's K/V at their prompt positions (this rank's heads), the GDN final states,
    and this rank's K/V bytes."""
    import torch.distributed as dist

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.cp import local_positions
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import capture

    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(tp=tp, cp=cp), device="cpu"))
    model = build_model(m, par, "cpu")
    load_full(model, full)
    st = capture(model, torch.tensor([prompt[:-1]]), ReplayConfig(mode=mode, chunk_len=7))
    cp_rank = par.pgs.cp.rank()
    kv, gdn = {}, {}
    for n, layer in st.layers.items():
        if hasattr(layer, "k"):
            pos = [s + i for (s, e) in st.chunk_bounds for i in local_positions(e - s, cp, cp_rank)]
            kv[n] = (pos, layer.k[0].clone(), layer.v[0].clone())
        else:
            gdn[n] = (layer.current.conv.clone(), layer.current.recurrent.clone())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (par.pgs.tp.rank(), kv))
    return every, gdn, st.nbytes_by_type()["attention_kv"], par.pgs.tp.rank()


def _memory(m, full):
    """CP=2: per-rank K/V bytes with chunks divisible by 2 x CP, and the peak of a group step at G=2, 8."""
    from group_peaks import group_peaks

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import capture

    out = {}
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, m.vocab_size, (257,), generator=gen).tolist()
    for cp in (1, 2):
        par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(cp=cp), device="cpu"))
        model = build_model(m, par, "cpu")
        load_full(model, full)
        st = capture(model, torch.tensor([prompt[:-1]]), ReplayConfig(chunk_len=64))
        out[f"kv_bytes_cp{cp}"] = st.nbytes_by_type()["attention_kv"]
    out.update(group_peaks(model, m, par.device, prompt, gen))
    return out


def _worker(rank, world_size, layouts, memory=False):
    from hf_reference import build_hf_model, hf_state

    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore

    m = _model_cfg()
    full = hf_to_mcore(hf_state(build_hf_model(m, seed=64)), m)
    groups = _groups(m)
    out = {"steps": {}, "capture": {}}
    for mode in ("detached", "exact"):
        ref = _step(m, full, groups, 1, 1, mode)
        for name, tp, cp in layouts:
            out["steps"][(name, mode)] = compare(ref, _step(m, full, groups, tp, cp, mode))
    prompt = groups[1].prompt
    ref_every, ref_gdn, ref_bytes, _ = _captured(m, full, prompt, 1, 1, "exact")
    ref_k = {n: (torch.stack([k for k in kvs[1]]), kvs[2]) for n, kvs in ref_every[0][1].items()}
    for name, tp, cp in layouts:
        if tp * cp != world_size and name != "cp2":
            continue  # the capture is checked where CP spans the world (and at TP x CP)
        every, gdn, nbytes, tp_rank = _captured(m, full, prompt, tp, cp, "exact")
        worst = 0.0
        for n in ref_k:
            k_full, v_full = ref_k[n]
            hk = k_full.shape[1] // tp
            for r_tp, kv in every:
                if r_tp != tp_rank:
                    continue
                pos, k, v = kv[n]
                idx = torch.tensor(pos, dtype=torch.long)
                worst = max(worst, rel(k, k_full[idx][:, tp_rank * hk:(tp_rank + 1) * hk]),
                            rel(v, v_full[idx][:, tp_rank * hk:(tp_rank + 1) * hk]))
        if tp == 1:
            worst = max([worst] + [rel(gdn[n][i], ref_gdn[n][i]) for n in gdn for i in (0, 1)])
        out["capture"][name] = dict(kv=worst, bytes=nbytes, ref_bytes=ref_bytes // tp, cp=cp)
    if memory:
        out["memory"] = _memory(m, full)
    return out


def _check(outs):
    for rank, out in enumerate(outs):
        check_steps(out["steps"], rank)
        for name, r in out["capture"].items():
            if rank == 0:
                print(f"{name} capture: state vs single rank {r['kv']:.1e}; K/V bytes on this rank {r['bytes']} "
                      f"(single rank / CP: {r['ref_bytes'] / r['cp']:.0f})")
            assert r["kv"] <= 1e-12, (name, r)
    for name in outs[0]["capture"]:
        by_rank = [o["capture"][name]["bytes"] for o in outs]
        ref, cp = outs[0]["capture"][name]["ref_bytes"], outs[0]["capture"][name]["cp"]
        # every position's K/V on exactly one CP rank of each replica (ref: one TP rank's single-rank bytes)
        assert sum(by_rank) == ref * len(outs) // cp, (name, by_rank, ref)


def test_cp2_equals_single_rank_and_memory():
    outs = run_ranks(_worker, 2, [("cp2", 1, 2)], True, timeout_s=900)
    _check(outs)
    for rank, out in enumerate(outs):
        mem = out["memory"]
        print(f"CP=2 rank {rank}: K/V bytes {mem['kv_bytes_cp2']} of {mem['kv_bytes_cp1']} at CP=1 (256 positions, "
              f"chunks of 64); group-step peak G=2 {mem['peaks'][2]} B, G=8 {mem['peaks'][8]} B, one branch's "
              f"scratch {mem['scratch']} B")
        assert mem["kv_bytes_cp2"] * 2 == mem["kv_bytes_cp1"]  # chunks divisible by 2 x CP: exactly half
        assert mem["peaks"][8] - mem["peaks"][2] <= mem["scratch"], mem  # as tests/replay/test_memory.py


def test_cp4_tp2cp2_dp2cp2_equal_single_rank():
    _check(run_ranks(_worker, 4, [("cp4", 1, 4), ("tp2cp2", 2, 2), ("dp2cp2", 1, 2)], timeout_s=900))
