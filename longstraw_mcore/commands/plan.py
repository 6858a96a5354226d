"""`longstraw plan`: per-rank memory by component and FLOPs / time by phase for a config, layout, P, R,
G, mode and device; whether it fits and the largest P that does (planner/memory.py, planner/flops.py).
No process group, no Megatron, no allocation: it runs anywhere in a second.

  longstraw plan --config CFG --prompt-len P --group-size G --response-len R --gpus N
      [--device H20-96GB | H100-80GB | H200-141GB] [--device-gib X] [--efficiency F] [--json] [--png FILE]
      [key=value ...]
"""

from __future__ import annotations

import json

from longstraw_mcore.commands.common import load_run_config
from longstraw_mcore.config import ConfigError
from longstraw_mcore.families import get_family


def plan(cfg, P: int, R: int, G: int, gpus: int, device: str, device_gib: float | None, efficiency: float) -> dict:
    """The plan as the `--json` schema (ARCHITECTURE.md section 5) plus the inputs and time per phase."""
    from longstraw_mcore.planner.memory import device_profile, max_prompt_len, phase_bytes, plan_memory

    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus {gpus!r}: must be a positive integer")
    if not 0 < efficiency <= 1:
        raise ConfigError(f"--efficiency {efficiency}: must be in (0, 1] (the fraction of the bf16 peak reached)")
    dev = device_profile(device, device_gib)
    family = get_family(cfg.model.family)
    per = plan_memory(family, cfg, P, R, G, gpus, cuda=True)  # the device profiles are GPUs
    total = sum(per.values())
    out = {"per_rank_bytes": per, "total_per_rank_bytes": total, "device_bytes": dev.memory_bytes,
           "fits": total <= dev.memory_bytes,
           "max_prompt_len": max_prompt_len(family, cfg, R, G, gpus, dev.memory_bytes, cuda=True),
           "flops": None, "seconds": None,
           "activations_by_phase_last_stage": phase_bytes(family, cfg, P, R, G, _last_stage(cfg), True),
           "inputs": {"family": cfg.model.family, "prompt_len": P, "response_len": R, "group_size": G, "gpus": gpus,
                      "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "cp": cfg.parallel.cp,
                                 "ep": cfg.parallel.ep, "dp": cfg.parallel.dp_for(gpus)},
                      "mode": cfg.replay.mode, "device": dev.name, "efficiency": efficiency}}
    from longstraw_mcore.planner.flops import step_flops

    p = cfg.parallel
    # per rank: the layer records count one TP rank (the largest); pp splits every phase; capture and the
    # prompt backward are split over cp too (each CP rank its share of the prompt), branches run whole on
    # every CP rank
    phases = step_flops(family.layers, cfg.model, P, [R] * G, cfg.replay.mode, cfg.replay.chunk_len,
                        p.tp)["algorithm"]
    split = {ph: p.pp * (p.cp if ph != "replay" else 1) for ph in phases if ph != "total"}
    out["flops"] = {ph: phases[ph] / split[ph] for ph in split}
    out["seconds"] = {ph: f / (dev.bf16_flops * efficiency) for ph, f in out["flops"].items()}
    return out


def _last_stage(cfg) -> range:
    stages = cfg.parallel.stage_layers(cfg.model.num_layers)
    return range(sum(stages[:-1]), cfg.model.num_layers)


def table(res: dict) -> str:
    gib = 2**30
    i = res["inputs"]
    lines = [f"plan: {i['family']}, P={i['prompt_len']:,} R={i['response_len']} G={i['group_size']}, {i['mode']} mode, "
             f"layout {i['layout']} on {i['gpus']} x {i['device']}",
             "| component | GiB per rank |", "|---|---|"]
    lines += [f"| {k} | {v / gib:.2f} |" for k, v in res["per_rank_bytes"].items()]
    lines.append(f"| **total** | **{res['total_per_rank_bytes'] / gib:.2f}** of {res['device_bytes'] / gib:.2f} |")
    lines.append(f"fits: {'yes' if res['fits'] else 'NO'}; largest prompt that fits: {res['max_prompt_len']:,} tokens")
    lines.append("| phase | TFLOP per rank | seconds at {:.0%} of the bf16 peak |".format(i["efficiency"]))
    lines.append("|---|---|---|")
    lines += [f"| {ph} | {f / 1e12:,.1f} | {res['seconds'][ph]:,.1f} |" for ph, f in res["flops"].items()]
    return "\n".join(lines)


def run(args) -> int:
    import os

    if args.png is not None:
        folder = os.path.dirname(os.path.abspath(args.png))
        if not args.png.endswith(".png") or not os.path.isdir(folder):
            raise ConfigError(f"--png {args.png!r}: must name a .png file in an existing folder")
    cfg = load_run_config(args)
    res = plan(cfg, args.prompt_len, args.response_len, args.group_size, args.gpus, args.device, args.device_gib,
               args.efficiency)
    if args.png:
        from longstraw_mcore.planner.chart import plan_chart

        plan_chart(res, args.png)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(table(res))
        if args.png:
            print(f"chart: {args.png}")
    return 0
