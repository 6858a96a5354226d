"""`longstraw plan`: per-rank device memory by component, host memory per rank and per node, and FLOPs /
time by phase for a config, layout, P, R, G, mode and device; whether it fits and the largest P that
does (planner/memory.py, planner/timing.py); each phase's time at its efficiency from the device table
(planner/efficiency.py: measured on H200, derived elsewhere, each figure printed with its source), or
at one `--efficiency F` for every phase. With --suggest, the fastest layout and memory switches that
fit (planner/suggest.py) and the overrides that run it. No process group, no Megatron, no allocation.

  longstraw plan --config CFG --prompt-len P --group-size G --response-len R --gpus N
  longstraw plan --config CFG --prompt-len P --tree WIDTHS:LENGTHS --gpus N   (a prefix-tree group)
      [--device H20-96GB | H20-141GB | H100-80GB | H200-141GB] [--device-gib X] [--host-gib X]
      [--gpus-per-node N] [--efficiency F] [--suggest] [--json] [--png FILE] [key=value ...]

Nothing fits with --suggest: the closest plan and what it misses on stderr, exit status 2 (with --json
the closest plan is printed as well).
"""

from __future__ import annotations

import json

from longstraw_mcore.commands.common import load_run_config
from longstraw_mcore.config import ConfigError
from longstraw_mcore.families import get_family

GIB = 2**30


def plan(cfg, P: int, R: int, G: int, gpus: int, device: str, device_gib: float | None,
         efficiency: float | None, host_gib: float | None = None, gpus_per_node: int | None = None,
         tree=None) -> dict:
    """The plan as the `--json` schema (ARCHITECTURE.md section 5) plus the host side, the inputs and
    time per phase (`efficiency`: None for the device table's per-phase figures, or one fraction of the
    bf16 peak for every phase; `host_gib`: host memory per node, default planner/memory.HOST_GIB;
    `tree`: the group as a full prefix tree (widths, lengths), planner/tree.py: its FLOPs and time count
    every shared segment once, and the live path's segment states join the device memory; the largest
    prompt is the flat group's)."""
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.efficiency import run_kernels
    from longstraw_mcore.planner.memory import (GPUS_PER_NODE, HOST_GIB, max_prompt_len, node_ranks, phase_bytes,
                                                plan_both)
    from longstraw_mcore.planner.timing import plan_time
    from longstraw_mcore.parallel.cp import gdn_path

    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus {gpus!r}: must be a positive integer")
    host_gib = HOST_GIB if host_gib is None else host_gib
    if not host_gib > 0:
        raise ConfigError(f"--host-gib {host_gib}: must be > 0 (host memory per node, GiB)")
    per_node = node_ranks(gpus, GPUS_PER_NODE if gpus_per_node is None else gpus_per_node)
    dev = device_profile(device, device_gib)
    host_limit = int(host_gib * GIB)
    family = get_family(cfg.model.family)
    per, host = plan_both(family, cfg, P, R, G, gpus, cuda=True)  # the device profiles are GPUs
    pieces = passes = None
    if tree is not None:
        from longstraw_mcore.planner.tree import path_state_bytes, tree_passes, tree_pieces

        pieces = tree_pieces(*tree)
        passes = tree_passes(*tree, cfg.replay.batch_tokens)
        stages, lo = cfg.parallel.stage_layers(cfg.model.num_layers), 0
        worst = 0
        for n in stages:
            worst = max(worst, path_state_bytes(family, cfg, tree[1], cfg.model.layer_types[lo:lo + n]))
            lo += n
        per = dict(per, tree_segments=worst)
    total, host_total = sum(per.values()), sum(host.values())
    p, mem = cfg.parallel, cfg.memory
    out = {"per_rank_bytes": per, "total_per_rank_bytes": total, "device_bytes": dev.memory_bytes,
           "host_per_rank_bytes": host, "total_host_per_rank_bytes": host_total,
           "host_per_node_bytes": host_total * per_node, "host_bytes_per_node": host_limit,
           "fits_device": total <= dev.memory_bytes, "fits_host": host_total * per_node <= host_limit,
           "max_prompt_len": max_prompt_len(family, cfg, R, G, gpus, dev.memory_bytes, cuda=True,
                                            host_bytes_per_node=host_limit, gpus_per_node=per_node),
           "activations_by_phase_last_stage": phase_bytes(family, cfg, P, R, G, _last_stage(cfg), True),
           "inputs": {"family": cfg.model.family, "prompt_len": P, "response_len": R, "group_size": G, "gpus": gpus,
                      "gpus_per_node": per_node,
                      "layout": {"tp": p.tp, "pp": p.pp, **({"vpp": p.vpp} if p.vpp > 1 else {}), "cp": p.cp,
                                 "ep": p.ep, "dp": p.dp_for(gpus),
                                 **({"gdn": gdn} if (gdn := gdn_path(cfg.model, p.tp, p.cp)) else {})},
                      "mode": cfg.replay.mode, "device": dev.name, "efficiency": efficiency,
                      "kernels": run_kernels(cfg),
                      "memory": {"recompute": mem.recompute, "state_offload": mem.state_offload,
                                 "state_dtype": mem.state_dtype, "optimizer_offload": mem.optimizer_offload,
                                 "grad_offload": mem.grad_offload, "mla_query_block": mem.mla_query_block},
                      "grad_reduction": cfg.train.grad_reduction, "adapter_rank": cfg.adapter.rank}}
    if tree is not None:
        out["inputs"]["tree"] = {"widths": list(tree[0]), "lengths": list(tree[1]), "response_tokens": G * R,
                                 "replayed_tokens": sum(p[0] for p in pieces)}
    out["fits"] = out["fits_device"] and out["fits_host"]
    # time: a model (planner/timing.py): each phase's FLOPs at its efficiency (planner/efficiency.py, or
    # --efficiency for all), transfers and the CPU optimizer at constant rates, no communication
    out.update(plan_time(family, cfg, P, R, G, gpus, dev, efficiency, host, pieces, passes))
    out["time_model"] = ("an estimate, not a measurement: each phase's FLOPs at its efficiency (a fraction of the bf16 "
                         "peak: \"efficiency\", measured or derived, planner/efficiency.py), PCIe and CPU Adam at "
                         "constant rates, nothing overlapped, no communication (planner/timing.py)")
    return out


def _last_stage(cfg) -> range:
    stages = cfg.parallel.stage_layers(cfg.model.num_layers)
    return range(sum(stages[:-1]), cfg.model.num_layers)


def table(res: dict) -> str:
    i = res["inputs"]
    lines = [f"plan: {i['family']}, P={i['prompt_len']:,} R={i['response_len']} G={i['group_size']}, {i['mode']} mode, "
             f"layout {i['layout']} on {i['gpus']} x {i['device']}, memory {i['memory']}, "
             f"grad_reduction={i['grad_reduction']}",
             "| component | device GiB per rank | host GiB per rank |", "|---|---|---|"]
    if "tree" in i:
        t = i["tree"]
        lines.insert(1, f"prefix tree {t['widths']} x {t['lengths']}: {t['replayed_tokens']:,} of "
                        f"{t['response_tokens']:,} response tokens replayed")
    host = res["host_per_rank_bytes"]
    keys = list(res["per_rank_bytes"]) + [k for k in host if k not in res["per_rank_bytes"]]
    lines += [f"| {k} | {res['per_rank_bytes'].get(k, 0) / GIB:.2f} | {host.get(k, 0) / GIB:.2f} |" for k in keys]
    lines.append(f"| **total** | **{res['total_per_rank_bytes'] / GIB:.2f}** of {res['device_bytes'] / GIB:.2f} | "
                 f"**{res['total_host_per_rank_bytes'] / GIB:.2f}** (per node of {i['gpus_per_node']}: "
                 f"{res['host_per_node_bytes'] / GIB:.2f} of {res['host_bytes_per_node'] / GIB:.0f}) |")
    verdict = "yes" if res["fits"] else "NO (" + ", ".join(
        w for w, ok in (("device", res["fits_device"]), ("host", res["fits_host"])) if not ok) + ")"
    lines.append(f"fits: {verdict}; largest prompt that fits: {res['max_prompt_len']:,} tokens")
    if "critic_weights" in res["per_rank_bytes"]:
        lines.append("critic (grpo.objective=ppo): on the same ranks, time-shared: its weights, gradients and "
                     "optimizer beside the policy's; its prompt state and activations only during its own pass, "
                     "before the policy's (planned at the policy's dimensions)")
    lines.append("| term | TFLOP per rank | efficiency (of the bf16 peak) | seconds |")
    lines.append("|---|---|---|---|")
    for term, s in res["seconds"].items():
        f, e = res["flops"].get(term), res["efficiency"].get(term)
        eff = "" if e is None else f"{e['value']:.2%} {e['source']}: {e['from']}"
        lines.append(f"| {term} | {'' if f is None else f'{f / 1e12:,.1f}'} | {eff} | {s:,.1f} |")
    k = i["kernels"]
    if res["efficiency_measured_on"]:
        lines.append(f"efficiency figures from {res['efficiency_measured_on']} (planner/efficiency.py)")
    lines += [f"efficiency: kernels gdn={k['gdn']} attention={k['attention']} on CUDA; {n}"
              for n in res["efficiency_notes"]]
    b = res["bubble"]
    if b["schedule"] != "none":
        idle = ", ".join(f"{ph} {f:.1%} of {b['micro_batches']['replay' if ph == 'replay' else 'capture']}"
                         for ph, f in b["idle_fraction"].items())
        lines.append(f"pipeline bubble ({b['schedule']}; idle fraction of a phase over its micro-batches): {idle}")
    lines.append(f"seconds per prompt group (total / dp {i['layout']['dp']}): {res['seconds_per_group']:,.1f} "
                 "(a model: planner/timing.py)")
    return "\n".join(lines)


def _suggest(args, cfg) -> tuple[dict, int]:
    """--suggest: the search, then the full plan of its choice. Returns (the JSON, exit status)."""
    import sys

    from longstraw_mcore.config import config_to_dict
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.memory import GPUS_PER_NODE, HOST_GIB
    from longstraw_mcore.planner.suggest import describe, miss_line, suggest

    if args.prompt_len < 1 or args.response_len < 1 or args.group_size < 1 or args.gpus < 1:
        raise ConfigError(f"--prompt-len {args.prompt_len}, --response-len {args.response_len}, --group-size "
                          f"{args.group_size}, --gpus {args.gpus}: each must be a positive integer")
    dev = device_profile(args.device, args.device_gib)
    host_gib = HOST_GIB if args.host_gib is None else args.host_gib
    if not host_gib > 0:
        raise ConfigError(f"--host-gib {host_gib}: must be > 0 (host memory per node, GiB)")
    per_node = GPUS_PER_NODE if args.gpus_per_node is None else args.gpus_per_node
    found = suggest(get_family(cfg.model.family), config_to_dict(cfg), args.prompt_len, args.response_len,
                    args.group_size, args.gpus, dev, args.efficiency, int(host_gib * GIB), per_node)
    c = found["best"]
    res = plan(c.cfg, args.prompt_len, args.response_len, args.group_size, args.gpus, args.device, args.device_gib,
               args.efficiency, host_gib, per_node)
    res["suggest"] = {"overrides": c.overrides, "plan": dict(res), "fits": found["fits"],
                      "layout_and_switches": describe(c, args.gpus), "plans_searched": found["searched"],
                      "layouts": found["layouts"], "search_seconds": round(found["seconds"], 2),
                      "misses_gib": {k: v / GIB for k, v in c.misses.items() if k != "host_per_rank"}}
    if not found["fits"]:
        if args.json:
            print(json.dumps(res, indent=1))
        raise ConfigError(miss_line(c, args.gpus, dev, int(host_gib * GIB), found["searched"]))
    if not args.json:
        print(f"suggest: {describe(c, args.gpus)} ({found['searched']} plans of {found['layouts']} layouts searched "
              f"in {found['seconds']:.1f} s)\n"
              f"  device {res['total_per_rank_bytes'] / GIB:.2f} GiB per rank, host "
              f"{res['host_per_node_bytes'] / GIB:.2f} GiB per node, {res['seconds_per_group']:,.0f} s per prompt "
              f"group (time model)\n  overrides: {' '.join(c.overrides)}", file=sys.stdout)
    return res, 0


def run(args) -> int:
    import os

    if args.png is not None:
        folder = os.path.dirname(os.path.abspath(args.png))
        if not args.png.endswith(".png") or not os.path.isdir(folder):
            raise ConfigError(f"--png {args.png!r}: must name a .png file in an existing folder")
    tree = None
    if args.tree is not None:
        from longstraw_mcore.planner.tree import parse_tree, responses_and_length

        tree = parse_tree(args.tree)
        G, R = responses_and_length(*tree)
        if args.suggest or (args.group_size, args.response_len) not in ((None, None), (G, R)):
            raise ConfigError(f"--tree {args.tree} (G={G}, R={R}): give it without --suggest (the search plans flat "
                              f"groups) and without another --group-size / --response-len")
        args.group_size, args.response_len = G, R
    elif args.group_size is None or args.response_len is None:
        raise ConfigError("plan: give --response-len and --group-size, or --tree WIDTHS:LENGTHS")
    cfg = load_run_config(args)
    if args.suggest:
        res, _ = _suggest(args, cfg)
    else:
        res = plan(cfg, args.prompt_len, args.response_len, args.group_size, args.gpus, args.device, args.device_gib,
                   args.efficiency, args.host_gib, args.gpus_per_node, tree)
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
