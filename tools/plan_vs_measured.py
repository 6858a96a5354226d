#!/usr/bin/env python
"""The memory planner against measurement: the step's peak above the parameters, planned
(planner/memory.step_peak_bytes) and measured, per point; prints a table and writes JSON.

  python tools/plan_vs_measured.py [--points cpu,h200] [--only SUBSTRING] [--out plan_vs_measured.json]

`--only`: the points whose name contains SUBSTRING only (e.g. `--only glm`: the CPU set takes long).

What both count: the bytes a replay step allocates on top of the parameters at its worst moment, with
the model's gradients as plain `.grad` tensors (no DDP; as tools/bench_replay.py runs it): gradients,
prompt state, exact mode's state gradient, the worst phase's activations. With the memory switches
(config/memory.py) the device and host sides apart. On a CPU-only machine both live in the same RAM,
so "host" is told apart by ownership: the host side is the prompt state's homes (memory/staging.py)
and exact mode's state gradients made from them, counted storage by storage from the live state
(they are allocated before the step's worst moment and alive through it); the device side is the
profiler's peak minus those bytes. memory.grad_offload's host buffers and shards (memory/grad_stage.py,
train/zero2.py) are allocated before the step, so the step's peak does not contain them: they are
the host side as counted by the holder, and the device side is the peak as measured (the buckets
the reduction builds, the gradients autograd is still making). On CUDA (scripts/gpu_check.sh) the allocator counts device bytes
only and the host side is the same storage count.
  cpu   measured here: 2 gloo ranks, the tiny configs at several layouts, P, R, G, dtypes and both modes;
        PyTorch's profiler counts every CPU tensor allocation (bench/memory.measure_memory), the CPU twin
        of the CUDA allocator's peak. Under CP the figure is an upper bound (a buffer freed on a gloo
        thread is not seen). The largest rank of each layout. One branch per replay micro-step
        (replay.batch_tokens=0) unless the point sets a budget: the planner counts every micro-step with
        the step's gradients alive (as they are under DDP's buffer, or from a group's second micro-step
        on), and a group replayed as one micro-step with plain `.grad` tensors makes them during its
        only backward, so its peak is lower by up to their bytes (tiny Qwen f32, R=96, G=4 in one
        micro-step, recompute=layer: planned 7.49 MiB, measured 6.12; the same 384 tokens as one branch
        of G=2 per micro-step: 6.95): there the plan is an upper bound. The batched points run G=4 in
        two micro-steps.
  cuda  the memory-switch points on this machine's GPU, one rank (scripts/gpu_check.sh runs it)
  h200  the measured rows of bench_results/h200_qwen27b_4layer_bench.json (tools/bench_replay.py on one
        H200: Qwen3.6-27B at its real width, 4 layers, bf16, P 8K-128K, R 1K, G 2/8, both modes, one
        branch per micro-step; torch.cuda.max_memory_allocated above the weights, which are not counted;
        their .grad are).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# measured on one H200 at project commit e25be36 (tools/bench_replay.py, every kernel the plain-torch twin)
H200 = os.path.join(ROOT, "bench_results", "h200_qwen27b_4layer_bench.json")

# (name, config, overrides, P, R, G, layout overrides). Points without a layout override are data parallel
# with no gradient reduction: every rank would measure the same numbers, so the ranks take them in turn
# (`_replicated`); the others run on every rank.
CPU_POINTS = [
    ("qwen tiny f32 detached", "configs/qwen3.6-tiny.yaml", ["replay.mode=detached"], 300, 96, 4, []),
    ("qwen tiny f32 exact, chunk 96", "configs/qwen3.6-tiny.yaml", ["replay.mode=exact", "replay.chunk_len=96"],
     300, 96, 4, []),
    ("qwen tiny bf16 exact, chunk 64", "configs/qwen3.6-tiny.yaml",
     ["model.dtype=bfloat16", "replay.mode=exact", "replay.chunk_len=64"], 400, 64, 2, []),
    ("qwen tiny f32 V=16384 detached", "configs/qwen3.6-tiny.yaml",
     ["model.vocab_size=16384", "replay.mode=detached"], 200, 128, 2, []),
    ("qwen tiny f64 exact, chunk 32", "configs/qwen3.6-tiny.yaml",
     ["model.dtype=float64", "replay.mode=exact", "replay.chunk_len=32"], 200, 48, 3, []),
    ("qwen tiny f32 exact TP=2", "configs/qwen3.6-tiny.yaml", ["replay.mode=exact"], 300, 96, 2, ["parallel.tp=2"]),
    ("qwen tiny f32 exact CP=2", "configs/qwen3.6-tiny.yaml", ["replay.mode=exact"], 300, 96, 2, ["parallel.cp=2"]),
    ("glm tiny f32 exact (4 layers)", "configs/glm-5.2-tiny.yaml",
     ["model.num_layers=4", "replay.mode=exact"], 200, 64, 2, []),
    ("qwen tiny f32 LoRA r4 detached", "configs/qwen3.6-tiny.yaml", ["adapter.rank=4", "replay.mode=detached"],
     300, 96, 4, []),
    ("qwen tiny f32 LoRA r4 exact, chunk 96", "configs/qwen3.6-tiny.yaml",
     ["adapter.rank=4", "replay.mode=exact", "replay.chunk_len=96"], 300, 96, 4, []),
    ("qwen tiny f32 QLoRA nf4 r4 detached", "configs/qwen3.6-tiny.yaml",
     ["adapter.rank=4", "adapter.base_dtype=nf4", "replay.mode=detached"], 300, 96, 4, []),
    ("qwen tiny f32 QLoRA nf4 r4 exact TP=2", "configs/qwen3.6-tiny.yaml",
     ["adapter.rank=4", "adapter.base_dtype=nf4", "replay.mode=exact"], 300, 96, 2, ["parallel.tp=2"]),
    # the attention kernels' own moments: flash's capture on a model of attention layers only (no score
    # blocks), and the plain twin's score blocks (ops.attention=plain) in the capture and under recompute
    ("qwen tiny bf16 attention layers detached P=1200", "configs/qwen3.6-tiny.yaml",
     ["model.num_layers=2", "model.full_attention_interval=1", "model.intermediate_size=8", "model.dtype=bfloat16",
      "replay.mode=detached"], 1200, 32, 2, []),
    ("qwen tiny f32 detached P=1200, twin", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "ops.attention=plain"], 1200, 64, 2, []),
    ("qwen tiny f32 exact chunk 96, recompute=layer, twin", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=exact", "replay.chunk_len=96", "memory.recompute=layer", "ops.attention=plain"], 300, 96, 4, []),
    # the memory switches (config/memory.py): device and host bytes apart
    ("qwen tiny f32 detached P=1200", "configs/qwen3.6-tiny.yaml", ["replay.mode=detached"], 1200, 64, 2, []),
    ("qwen tiny f32 detached, recompute=layer", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "memory.recompute=layer"], 300, 96, 4, []),
    ("qwen tiny f32 exact chunk 96, recompute=layer", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=exact", "replay.chunk_len=96", "memory.recompute=layer"], 300, 96, 4, []),
    ("qwen tiny f32 exact, recompute + state offload", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=exact", "memory.recompute=layer", "memory.state_offload=true"], 1200, 64, 2, []),
    ("qwen tiny f32 detached, recompute + state offload", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "memory.recompute=layer", "memory.state_offload=true"], 1200, 64, 2, []),
    ("qwen tiny f32 detached, recompute + fp8 state", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "memory.recompute=layer", "memory.state_dtype=fp8"], 1200, 64, 2, []),
    ("qwen tiny f32 detached, recompute + fp8 state offload", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "memory.recompute=layer", "memory.state_dtype=fp8", "memory.state_offload=true"],
     1200, 64, 2, []),
    ("glm tiny f32 detached (4 layers), recompute + MLA query blocks of 16", "configs/glm-5.2-tiny.yaml",
     ["model.num_layers=4", "replay.mode=detached", "memory.recompute=layer", "memory.mla_query_block=16"],
     200, 64, 2, []),
    ("glm tiny f32 exact (4 layers), recompute + offload + MLA query blocks", "configs/glm-5.2-tiny.yaml",
     ["model.num_layers=4", "replay.mode=exact", "memory.recompute=layer", "memory.state_offload=true",
      "memory.mla_query_block=16"], 400, 64, 2, []),
    # train.grad_reduction=micro_step through its holder (train/zero2.py), data parallel over the 2 ranks
    ("qwen tiny f32 detached, micro_step", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "train.grad_reduction=micro_step"], 300, 96, 4, []),
    ("qwen tiny f32 detached, micro_step + grad offload, buckets of 0.125 MiB", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "train.grad_reduction=micro_step", "memory.grad_offload=true",
      "train.grad_bucket_mib=0.125"], 300, 96, 4, []),
    ("qwen tiny bf16 exact chunk 96, micro_step + grad offload + recompute", "configs/qwen3.6-tiny.yaml",
     ["model.dtype=bfloat16", "replay.mode=exact", "replay.chunk_len=96", "train.grad_reduction=micro_step",
      "memory.grad_offload=true", "train.grad_bucket_mib=0.125", "memory.recompute=layer"], 300, 96, 4, []),
    # replay micro-steps of 2 branches (replay.batch_tokens = 2 R, G = 4: two micro-steps, the second with
    # the gradients alive, as the planner counts every micro-step); the points above run one branch each
    ("qwen tiny f32 detached, 2 branches per micro-step", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=detached", "replay.batch_tokens=192"], 300, 96, 4, []),
    ("qwen tiny f32 V=16384 detached, 2 branches per micro-step", "configs/qwen3.6-tiny.yaml",
     ["model.vocab_size=16384", "replay.mode=detached", "replay.batch_tokens=256"], 200, 128, 4, []),
    ("qwen tiny f32 exact chunk 96, recompute=layer, twin, 2 branches per micro-step", "configs/qwen3.6-tiny.yaml",
     ["replay.mode=exact", "replay.chunk_len=96", "memory.recompute=layer", "ops.attention=plain",
      "replay.batch_tokens=192"], 300, 96, 4, []),
]


SWITCH_POINTS = [pt for pt in CPU_POINTS if any(o.startswith("memory.") for o in pt[2])
                 and not any(o.startswith("ops.") for o in pt[2])]
"""The memory-switch points alone (`--points cuda`: measured on one GPU by scripts/gpu_check.sh)."""


def _replicated(overrides, layout) -> bool:
    """A point whose ranks are data-parallel replicas that never meet in the step (no layout override, no
    train.grad_reduction=micro_step holder): each rank would measure the same bytes, so one rank runs it."""
    return not layout and "train.grad_reduction=micro_step" not in overrides


def _cpu_worker(rank, world_size, points, device: str = "cpu"):
    import torch

    from longstraw_mcore.bench.memory import measure_memory
    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.memory.layers import apply
    from longstraw_mcore.ops.dispatch import configure
    from longstraw_mcore.planner.memory import step_host_bytes, step_peak_bytes
    from longstraw_mcore.replay.group_step import process_group

    out = []
    # On CUDA the first point runs twice and its first measure is dropped: what a process allocates at
    # its first step (cuBLAS's and cuBLASLt's workspaces, through the caching allocator) is fixed, not the
    # step's. On an H200 it put 62 MiB into the first point (67.7 MiB measured against 5.3 planned).
    warm = 1 if device == "cuda" and points else 0
    points = [*points[:warm], *points]
    turn = 0
    for name, config, overrides, P, R, G, layout in points:
        # one branch per replay micro-step unless the point sets a budget (the module docstring)
        cfg = load_config(os.path.join(ROOT, config), ["replay.batch_tokens=0", *overrides, *layout, f"device={device}"])
        par = setup_parallel(cfg)
        configure(cfg.ops)  # (the kernels the point names; the default choices otherwise)
        m = cfg.model
        family = get_family(m.family)
        model = family.build_model(m, par, device)
        if cfg.adapter.enabled:  # a new adapter (B = 0) on the frozen base, as `train` starts one
            from longstraw_mcore.adapters.attach import attach

            attach(model, family.checkpoint.adapter_sites(m), cfg.adapter, par, cfg.seed,
                   padded_vocab=model.padded_vocab_size if par.is_last_stage else None)
        g = torch.Generator().manual_seed(7)
        prompt = torch.randint(0, m.vocab_size, (P,), generator=g).tolist()
        responses = [torch.randint(0, m.vocab_size, (R - (b % 3),), generator=g).tolist() for b in range(G)]
        group = RolloutGroup(prompt=prompt, responses=responses, rewards=[float(b % 3) for b in range(G)])
        apply(model, cfg.memory)
        # every rank sets up every point (setup_parallel is collective); a replicated one is measured on one
        if world_size > 1 and _replicated(overrides, layout):  # the ranks in turn: None on the others
            turn += 1
            if (turn - 1) % world_size != rank:
                out.append(None)
                continue
        model.zero_grad(set_to_none=True)
        holder, holder_host = model, 0
        if cfg.train.grad_reduction == "micro_step":  # the shards (and grad_offload's host buffers) exist
            from longstraw_mcore.train.trainer import build_training  # before the step: not in its peak

            holder = build_training(model, cfg, par)[0]
            holder_host = holder.host_bytes()

        def step():
            process_group(holder, group, cfg.replay, cfg.grpo)
            if holder is not model:
                holder.finish()
        states = []
        gc.collect()  # what the previous point left in reference cycles is freed now, not inside this measure
        with _keep_states(states):
            _, peak, _, how = measure_memory(step, torch.device(device))
        host = sum(host_bytes(st) for st in states)  # alive through the whole step, so inside its peak
        fam = get_family(cfg.model.family)
        out.append({"name": name, "where": f"{device} ({world_size} rank{'s' if world_size > 1 else ''})",
                    "config": config, "overrides": overrides + layout, "P": P, "R": R, "G": G,
                    "mode": cfg.replay.mode, "measured_bytes": peak - host if device == "cpu" else peak, "how": how,
                    "planned_bytes": step_peak_bytes(fam, cfg, P, R, G, world_size, cuda=device == "cuda"),
                    "measured_host_bytes": host + holder_host,
                    "planned_host_bytes": step_host_bytes(fam, cfg, P, R, G, world_size)})
    return out[warm:]


def host_bytes(state) -> int:
    """The host-resident bytes of a prompt state (memory.state_offload): its homes, and exact mode's
    state gradients made from them (as they were just before the prompt backward released them),
    counted storage by storage."""
    return sum(state.nbytes_by_type("host").values()) + getattr(state, "host_grad_bytes", 0)


@contextlib.contextmanager
def _keep_states(into: list):
    """Record every prompt state the engine allocates (replay/engine.py's new_state) while the block runs."""
    from longstraw_mcore.replay import engine

    orig = engine.new_state

    def keeping(*a, **k):
        st = orig(*a, **k)
        release = st.release_grad

        def releasing():  # exact mode: the host gradients at their largest, before they are freed
            st.host_grad_bytes = max(getattr(st, "host_grad_bytes", 0), st.grad_nbytes_where("host"))
            release()

        st.release_grad = releasing
        into.append(st)
        return st

    engine.new_state = keeping
    try:
        yield
    finally:
        engine.new_state = orig


OPTIMIZER_POINTS = [
    ("qwen tiny f32 micro_step, optimizer offload", "configs/qwen3.6-tiny.yaml",
     ["train.grad_reduction=micro_step", "memory.optimizer_offload=true"], 300, 96, 4, []),
    ("qwen tiny bf16 micro_step, optimizer offload", "configs/qwen3.6-tiny.yaml",
     ["model.dtype=bfloat16", "train.grad_reduction=micro_step", "memory.optimizer_offload=true"], 300, 96, 4, []),
]
"""memory.optimizer_offload: the optimizer's host bytes after a train step (the micro_step shards on CPU;
Megatron's HybridDeviceOptimizer offloads CUDA parameters only, measured by scripts/gpu_check.sh's train)."""


def _optimizer_worker(rank, world_size, points):
    import torch

    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.memory import plan_host
    from longstraw_mcore.prompt_state.base import storage_bytes
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import build_training, finalize_grads

    out = []
    for name, config, overrides, P, R, G, layout in points:
        cfg = load_config(os.path.join(ROOT, config), [*overrides, *layout, "device=cpu"])
        par = setup_parallel(cfg)
        fam = get_family(cfg.model.family)
        model = fam.build_model(cfg.model, par, "cpu")
        holder, opt = build_training(model, cfg, par)
        g = torch.Generator().manual_seed(7 + rank)
        group = RolloutGroup(prompt=torch.randint(0, cfg.model.vocab_size, (P,), generator=g).tolist(),
                             responses=[torch.randint(0, cfg.model.vocab_size, (R,), generator=g).tolist()
                                        for _ in range(G)], rewards=[float(b % 3) for b in range(G)])
        holder.zero_grad_buffer()
        opt.zero_grad()
        process_group(holder, group, cfg.replay, cfg.grpo)
        finalize_grads(holder, par)
        inner, at_step = opt.optimizer, {}

        def step(*a, _orig=inner.step, **k):  # the host gradient shards exist while the update runs
            at_step["grads"] = storage_bytes([q.grad for grp in inner.param_groups for q in grp["params"]])
            return _orig(*a, **k)

        inner.step = step
        opt.step()
        held = [q for grp in inner.param_groups for q in grp["params"]] + \
            [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
        host = plan_host(fam, cfg, P, R, G, world_size, cuda=False)
        out.append({"name": name, "measured_host_bytes": storage_bytes(held) + at_step["grads"],
                    "planned_host_bytes": host["optimizer"] + host["optimizer_grads"],
                    "where": f"cpu ({world_size} ranks)", "overrides": overrides})
    return out


def optimizer_rows(points=OPTIMIZER_POINTS) -> list[dict]:
    from longstraw_mcore.launch_local import run_ranks

    return [dict(r, measured_host_bytes=max(x[i]["measured_host_bytes"] for x in per))
            for per in [run_ranks(_optimizer_worker, 2, points, timeout_s=600)] for i, r in enumerate(per[0])]


def optimizer_table(rows: list[dict]) -> str:
    lines = ["| optimizer in host memory | where | planned MiB | measured MiB | planned / measured |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['where']} | {r['planned_host_bytes'] / 2**20:,.3f} | "
                     f"{r['measured_host_bytes'] / 2**20:,.3f} | {r['planned_host_bytes'] / r['measured_host_bytes']:.3f} |")
    return "\n".join(lines)


def cpu_rows(points=CPU_POINTS, device: str = "cpu", ranks: int = 2) -> list[dict]:
    from longstraw_mcore.launch_local import run_ranks

    per_rank = run_ranks(_cpu_worker, ranks, points, device, timeout_s=1200)
    rows = []
    for i in range(len(points)):  # the largest of the ranks that ran the point (`_replicated`: one)
        ran = [r[i] for r in per_rank if r[i] is not None]
        rows.append(dict(ran[0], measured_bytes=max(r["measured_bytes"] for r in ran)))
    return rows


def h200_rows(path: str = H200) -> list[dict]:
    from longstraw_mcore.config import load_config
    from longstraw_mcore.planner.memory import step_peak_bytes
    from longstraw_mcore.families import get_family

    data = json.load(open(path))
    rows = []
    for r in data["rows"]:
        cfg = load_config(os.path.join(ROOT, "configs", "qwen3.6-27b.yaml"),
                          ["model.num_layers=4", "parallel.tp=1", "parallel.pp=1", "ops.attention=plain", f"replay.mode={r['mode']}",
                           f"replay.chunk_len={r['chunk_len']}", f"replay.attn_probs_budget_mib={r['attn_probs_budget_mib']}",
                           # rows from before replay.batch_tokens ran one branch per micro-step
                           f"replay.batch_tokens={r.get('batch_tokens', 0)}"])
        rows.append({"name": f"qwen3.6-27b 4 layers {r['mode']}", "where": "H200 (measured, bench27b.json)",
                     "config": "configs/qwen3.6-27b.yaml", "P": r["P"], "R": r["R"], "G": r["G"], "mode": r["mode"],
                     "measured_bytes": r["peak_bytes"], "how": "torch.cuda.max_memory_allocated above the weights",
                     "planned_bytes": step_peak_bytes(get_family(cfg.model.family), cfg, r["P"], r["R"], r["G"], 1, cuda=True)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| point | where | P | R | G | planned MiB | measured MiB | planned / measured | host: planned / measured MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        host = (f"{r['planned_host_bytes'] / 2**20:,.2f} / {r['measured_host_bytes'] / 2**20:,.2f}"
                if r.get("measured_host_bytes") else "")
        lines.append(f"| {r['name']} | {r['where']} | {r['P']:,} | {r['R']} | {r['G']} | {r['planned_bytes'] / 2**20:,.1f} | "
                     f"{r['measured_bytes'] / 2**20:,.1f} | {r['planned_bytes'] / r['measured_bytes']:.3f} | {host} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="cpu,h200", help="comma-separated: cpu, h200, cuda (the memory-switch "
                   "points measured on this machine's GPU, one rank)")
    p.add_argument("--only", default="", help="only the points whose name contains this substring")
    p.add_argument("--out", default="plan_vs_measured.json")
    a = p.parse_args(argv)
    wanted = set(a.points.split(","))
    if not wanted <= {"cpu", "h200", "cuda"}:
        p.error(f"--points {a.points!r}: choose from cpu, h200, cuda")

    def only(points):
        return [pt for pt in points if a.only in pt[0]]
    rows = ([r for r in h200_rows() if a.only in r["name"]] if "h200" in wanted else []) + \
        (cpu_rows(only(CPU_POINTS)) if "cpu" in wanted and only(CPU_POINTS) else []) + \
        (cpu_rows(only(SWITCH_POINTS), "cuda", 1) if "cuda" in wanted and only(SWITCH_POINTS) else [])
    if not rows:
        p.error(f"--only {a.only!r}: no point's name contains it")
    for r in rows:
        r["ratio"] = r["planned_bytes"] / r["measured_bytes"]
        if r.get("measured_host_bytes"):
            r["host_ratio"] = r["planned_host_bytes"] / r["measured_host_bytes"]
    print(table(rows))
    opt_rows = optimizer_rows(only(OPTIMIZER_POINTS)) if "cpu" in wanted and only(OPTIMIZER_POINTS) else []
    if opt_rows:
        print(optimizer_table(opt_rows))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"{len(rows)} points; worst |planned / measured - 1| = {worst:.1%}")
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rows": rows, "optimizer_rows": opt_rows}, f, indent=1)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
