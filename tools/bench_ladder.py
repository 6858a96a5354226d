#!/usr/bin/env python
"""How far one device goes on a config within a time budget: a ladder of prompt lengths, one model build.

  python tools/bench_ladder.py --config configs/published/qwen3.6-27b-qlora-2m-8xh20-96gb.yaml \
      --prompt-lens 32768,131072,524288,2097152 --budget-s 130 [--exact-prompt-lens 16384,65536 \
      --exact-budget-s 50] --response-len 1024 --group-size 8 --peak-tflops 989.4 --out ladder.json \
      parallel.tp=1

The model (with the config's adapters: an NF4 QLoRA base where it says so) is built once with random
weights, as `longstraw validate` builds it; a small untimed group first compiles and autotunes the
kernels. Then, per mode (detached over --prompt-lens within --budget-s, then exact over
--exact-prompt-lens within --exact-budget-s, if given), one GRPO group step (`process_group`: capture, replay, exact mode's prompt
backward; no optimizer) per prompt length in ascending order, while
  - the planner says it fits this device (planner/memory.py no_optimizer_plan: there is no optimizer
    here), and
  - its predicted seconds (the previous point's, scaled by the analytic FLOP ratio of
    planner/flops.py step_flops) fit in what is left of --budget-s.
Per point: seconds and tokens/s per phase, TFLOP/s per phase and overall from the analytic algorithm
FLOPs against --peak-tflops, the peak allocated bytes against the plan (CUDA: the allocator's peak
minus what was allocated before the model; CPU: not measured), the kernels each op ran
(ops/dispatch.py), and why the ladder stopped. The planner's largest fitting prompt is reported
beside the largest that ran. Prints one line per point and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _phase_tokens(P: int, R: int, G: int) -> dict:
    return {"capture": P - 1, "replay": R * G, "prompt_backward": P - 1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--prompt-lens", required=True, help="detached mode: ascending, comma-separated")
    p.add_argument("--budget-s", type=float, default=240.0, help="detached mode's timed points, seconds")
    p.add_argument("--exact-prompt-lens", default="", help="exact mode: ascending, comma-separated (none: skip)")
    p.add_argument("--exact-budget-s", type=float, default=60.0)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=989.4, help="the device's dense bf16 peak")
    p.add_argument("--warmup-prompt", type=int, default=2048)
    p.add_argument("--out", default="ladder.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    ladders = {"detached": (a.prompt_lens, a.budget_s)}
    if a.exact_prompt_lens:
        ladders["exact"] = (a.exact_prompt_lens, a.exact_budget_s)
    for mode, (text, _) in list(ladders.items()):
        lens = [int(x) for x in text.split(",")]
        if lens != sorted(lens) or min(lens) < 2:
            raise SystemExit(f"{mode} prompt lengths {text}: ascending lengths >= 2")
        ladders[mode] = (lens, ladders[mode][1])
    from longstraw_mcore.cli import quiet_expected_warnings

    quiet_expected_warnings()
    import dataclasses

    import torch

    from longstraw_mcore.commands.common import build_and_load
    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.ops import dispatch
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.flops import step_flops
    from longstraw_mcore.planner.memory import max_prompt_len, no_optimizer_plan
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import wrap_ddp_no_optimizer

    cfg = load_config(a.config, a.overrides)
    par = setup_parallel(cfg)
    if par.world_size != 1:
        raise SystemExit("bench_ladder runs one rank (one device)")
    family, m, R, G = get_family(cfg.model.family), cfg.model, a.response_len, a.group_size
    cuda = par.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    model = build_and_load(cfg, par, None, None, "ladder")
    ddp = wrap_ddp_no_optimizer(model, cfg, par)
    build_s = time.perf_counter() - t0
    device_bytes = torch.cuda.get_device_properties(par.device).total_memory if cuda else None
    gen = torch.Generator().manual_seed(0)

    def group(P):
        tok = lambda n: torch.randint(0, m.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
        return RolloutGroup(prompt=tok(P), responses=[tok(R) for _ in range(G)], rewards=[float(i % 3) for i in range(G)])

    def run(P, mode):
        rcfg = dataclasses.replace(cfg.replay, mode=mode)
        ddp.zero_grad_buffer()
        dispatch.reset_kernels()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        st = process_group(ddp, group(P), rcfg, cfg.grpo)
        if cuda:
            torch.cuda.synchronize()
        return st, time.perf_counter() - t

    run(a.warmup_prompt, "exact" if "exact" in ladders else "detached")  # compile / autotune, untimed
    out = {"config": a.config, "overrides": a.overrides, "device": str(par.device), "R": R, "G": G,
           "device_name": torch.cuda.get_device_name(par.device) if cuda else "cpu", "build_seconds": build_s,
           "peak_tflops": a.peak_tflops, "weights_bytes": (torch.cuda.memory_allocated() - base) if cuda else None,
           "modes": {}}
    for mode, (lens, budget) in ladders.items():
        c = dataclasses.replace(cfg, replay=dataclasses.replace(cfg.replay, mode=mode))
        fit = max_prompt_len(family, c, R, G, 1, device_bytes, cuda=True) if cuda else None
        rows, spent, last, stop = [], 0.0, None, "every length ran"
        for P in lens:
            plan = no_optimizer_plan(family, c, P, R, G, 1)
            fl = step_flops(family.layers, m, P, [R] * G, mode, cfg.replay.chunk_len, 1,
                            batch_tokens=cfg.replay.batch_tokens)["algorithm"]
            if cuda and sum(plan.values()) > device_bytes:
                stop = f"P={P}: planned {sum(plan.values()) / 2**30:.1f} GiB > the device's {device_bytes / 2**30:.1f} GiB"
                break
            if last is not None:
                guess = last[1] * sum(fl.values()) / sum(last[0].values())
                if spent + guess > budget:
                    stop = f"P={P}: predicted {guess:.0f} s > the {budget - spent:.0f} s left of its budget"
                    break
            st, secs = run(P, mode)
            spent += secs
            last = (fl, secs)
            ph = {k: v for k, v in (st.seconds or {}).items() if k != "total"}
            toks = _phase_tokens(P, R, G)
            row = {"P": P, "mode": mode, "seconds": secs, "phase_seconds": ph,
                   "tokens_per_s": {k: toks[k] / v for k, v in ph.items() if v > 0 and k in toks},
                   "tflops_per_s": {k: fl[k] / v / 1e12 for k, v in ph.items() if v > 0 and k in fl},
                   "tflops_per_s_total": sum(fl.values()) / secs / 1e12,
                   "planned_bytes": sum(plan.values()), "planned": plan, "state_bytes": st.state_bytes,
                   "kernels": dispatch.kernels_run()}
            row["fraction_of_peak"] = row['tflops_per_s_total'] / a.peak_tflops
            if cuda:
                row["measured_peak_bytes"] = torch.cuda.max_memory_allocated() - base
                row["measured_over_planned"] = row["measured_peak_bytes"] / row["planned_bytes"]
            rows.append(row)
            print(f"[ladder] {mode} P={P:,}: {secs:.1f} s, " + ", ".join(
                f"{k} {row['tokens_per_s'][k]:,.0f} tok/s ({row['tflops_per_s'][k]:.3g} TFLOP/s)" for k in row["tokens_per_s"])
                + f"; {row['tflops_per_s_total']:.3g} TFLOP/s = {row['fraction_of_peak']:.1%} of {a.peak_tflops:g}"
                + (f"; peak {row['measured_peak_bytes'] / 2**30:.1f} GiB vs plan {row['planned_bytes'] / 2**30:.1f} GiB"
                   if cuda else ""), flush=True)
        out["modes"][mode] = {"rows": rows, "stopped": stop, "budget_s": budget, "planner_largest_prompt": fit,
                              "largest_prompt_run": rows[-1]["P"] if rows else None}
        print(f"[ladder] {mode}: largest P run {out['modes'][mode]['largest_prompt_run']}, planner's largest fitting "
              f"{fit}; stopped: {stop}", flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
