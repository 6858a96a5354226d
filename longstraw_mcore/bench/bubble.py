"""The pipeline bubble measured: how long each stage waits inside Megatron's schedules during one group step
of branch replay, 1F1B (parallel.vpp = 1) against interleaved (vpp > 1), beside the planner's figure
(planner/timing.py `bubble`). `tools/bench_replay.py --bubble` runs it on CPU ranks (gloo).

A rank's wait is the time it spends inside Megatron's point-to-point exchange (every send and receive of
its schedules goes through `P2PCommunicator._communicate`: blocked on the peer, plus the copy itself,
small here), as a fraction of the schedule's wall time; per schedule: the capture (forward only, the
prompt's chunks) and the replay with, in exact mode, the prompt sweep (replay/pipeline.py). The
planner's idle fraction of a schedule of k micro-batches is (pp - 1) / (vpp k + pp - 1). Each point runs
the group step once untimed (allocations, first calls), then `repeats` times timed; the fractions are
the timed steps' sums. With more ranks than cores the stages also wait for a core: say so beside the
figures (`cores` in the JSON).

`stage_us` > 0 gives each stage a device of its own, as a GPU would: every transformer layer's forward
also sleeps stage_us microseconds per token it runs, its backward twice that (`_device_time`). A sleeping
rank holds no core, so more ranks than cores no longer slow each other and the waits are the schedule's;
the model's real arithmetic still runs (keep it small beside the sleeps: the JSON's `stage_us`).
"""

from __future__ import annotations

import os
import time

import torch


def _timed_p2p(box: dict):
    """Patch P2PCommunicator._communicate (this process only) to add its seconds to box["p2p"]."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if getattr(P2PCommunicator, "_bench_timed", False):
        return
    inner = P2PCommunicator._communicate

    def communicate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            box["p2p"] += time.perf_counter() - t0

    P2PCommunicator._communicate = communicate
    P2PCommunicator._bench_timed = True


def _timed_schedules(box: dict):
    """Wrap replay/pipeline.schedule: per schedule kind (capture: forward only; replay), wall and p2p seconds."""
    from longstraw_mcore.replay import pipeline

    inner = pipeline.schedule

    def schedule(model, pgs, config, data, forward_step, forward_only, *args, **kwargs):
        kind = "capture" if forward_only else "replay"
        p0, t0 = box["p2p"], time.perf_counter()
        try:
            return inner(model, pgs, config, data, forward_step, forward_only, *args, **kwargs)
        finally:
            if box["on"]:
                rec = box["kinds"].setdefault(kind, {"wall": 0.0, "wait": 0.0, "micro_batches": len(data)})
                rec["wall"] += time.perf_counter() - t0
                rec["wait"] += box["p2p"] - p0

    pipeline.schedule = schedule


class _Busy(torch.autograd.Function):
    """Identity whose backward sleeps `s` seconds (the layer's backward time on the emulated device)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.s)
        return g, None


def _device_time(model, stage_us: float) -> None:
    """Every layer of the rank's model chunks: its forward sleeps stage_us per token, its backward 2x."""
    from longstraw_mcore.replay.steps import cores_of

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        s = stage_us * 1e-6 * hidden.shape[0] * hidden.shape[1]
        time.sleep(s)
        if not hidden.requires_grad:
            return output
        hidden = _Busy.apply(hidden, 2 * s)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    for core in cores_of(model):
        for layer in core.decoder.layers:
            layer.register_forward_hook(hook)


def rank_point(rank: int, world: int, get_family, model_cfg: dict, pp: int, vpp: int, P: int, R: int, G: int,
               chunk_len: int, repeats: int, stage_us: float = 0.0) -> dict:
    """One layout's group steps on this rank (a run_ranks worker; `get_family`: the registry's lookup, handed
    down by the tool): {kind: {wall, wait, micro_batches}}."""
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.config.qwen3_5 import Qwen35Config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group

    torch.set_num_threads(1)
    m = Qwen35Config(**model_cfg)
    cfg = RunConfig(model=m, parallel=ParallelConfig(pp=pp, vpp=vpp), device="cpu")
    par = setup_parallel(cfg)
    torch.manual_seed(0)
    model = get_family(m.family).build_rank(m, par, "cpu")
    if stage_us > 0:
        _device_time(model, stage_us)
    gen = torch.Generator().manual_seed(1)
    group = RolloutGroup(prompt=torch.randint(0, m.vocab_size, (P,), generator=gen).tolist(),
                         responses=[torch.randint(0, m.vocab_size, (R,), generator=gen).tolist() for _ in range(G)],
                         rewards=[float(b) for b in range(G)])
    rcfg = ReplayConfig(mode="exact", chunk_len=chunk_len, batch_tokens=0)
    box = {"p2p": 0.0, "on": False, "kinds": {}}
    _timed_p2p(box)
    _timed_schedules(box)
    process_group(model, group, rcfg, GRPOConfig())  # untimed: first calls
    box["on"] = True
    for _ in range(repeats):
        process_group(model, group, rcfg, GRPOConfig())
    return box["kinds"]


def measure(get_family, points: list[tuple[int, int]], model_cfg: dict, P: int, R: int, G: int, chunk_len: int,
            repeats: int = 2, stage_us: float = 0.0, log=print) -> list[dict]:
    """Each (pp, vpp) point on pp CPU ranks: per schedule kind the measured wait fraction (mean and per
    stage) beside the planner's idle fraction."""
    from longstraw_mcore.launch_local import run_ranks
    from longstraw_mcore.planner.timing import bubble
    from longstraw_mcore.replay.plan import even_micro_steps

    n = -(-(P - 1) // chunk_len)
    k = {"capture": n, "replay": even_micro_steps(R, G, 0)[0] + n}
    rows = []
    for pp, vpp in points:
        t0 = time.perf_counter()
        ranks = run_ranks(rank_point, pp, get_family, model_cfg, pp, vpp, P, R, G, chunk_len, repeats, stage_us,
                          timeout_s=1800)
        row = {"pp": pp, "vpp": vpp, "cores": os.cpu_count(), "stage_us": stage_us,
               "seconds": round(time.perf_counter() - t0, 1)}
        for kind in ("capture", "replay"):
            per = [r[kind]["wait"] / r[kind]["wall"] for r in ranks]
            row[kind] = {"micro_batches": k[kind], "measured_wait_per_stage": per,
                         "measured_wait": sum(per) / len(per), "planned_idle": 1 - 1 / bubble(k[kind], pp, vpp),
                         "wall_s": max(r[kind]["wall"] for r in ranks)}
        log(f"pp={pp} vpp={vpp}: capture waits {row['capture']['measured_wait']:.1%} (planned "
            f"{row['capture']['planned_idle']:.1%}), replay + sweep {row['replay']['measured_wait']:.1%} (planned "
            f"{row['replay']['planned_idle']:.1%}); {row['seconds']:.0f} s")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| PP | schedule | capture: measured wait | planned idle | replay + sweep: measured wait | "
             "planned idle | replay + sweep wall s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        sched = "1F1B" if r["vpp"] == 1 else f"interleaved, VPP={r['vpp']}"
        c, p = r["capture"], r["replay"]
        lines.append(f"| {r['pp']} | {sched} | {c['measured_wait']:.1%} | {c['planned_idle']:.1%} | "
                     f"{p['measured_wait']:.1%} | {p['planned_idle']:.1%} | {p['wall_s']:.2f} |")
    return "\n".join(lines)
