#!/usr/bin/env python
"""Benchmark: branch replay (detached, exact) vs naive full-sequence GRPO on the same model and data.

  python tools/bench_replay.py [--config configs/qwen3.6-tiny.yaml] [--prompt-lens 4096,16384,65536]
      [--response-lens 256,1024] [--group-sizes 2,8] [--modes detached,exact] [--naive-max-prompt 16384]
      [--naive-copies N] [--out bench.json] [key=value ...]    (e.g. replay.attn_probs_budget_mib=4096)
  python tools/bench_replay.py --tree 1,2,2,4:24,24,6,10 --prompt-lens 4096 [--modes detached,exact]
  python tools/bench_replay.py --bubble 2:1,2:2,4:1,4:2 --prompt-lens 2049 --response-lens 32 --group-sizes 4
      [--chunk-len 256] [--stage-us 0] [--out bubble.json] [key=value ...]
  python tools/bench_replay.py --vs-transformers [--config configs/bench-hybrid-256.yaml] --prompt-lens 4096,16384
      --response-lens 128 --group-sizes 8 [--hf-full-copies N] [--paths hf_cache,detached,...] [--cold]
      [--out vs_hf.json]

--vs-transformers runs, in one process on the same weights, transformers' full sequences, transformers'
no-grad prompt cache + per-branch autograd, and our detached and exact modes, one branch per micro-step
(replay.batch_tokens=0) and batched (the config's replay.batch_tokens, the default unless set: what a
user gets) (longstraw_mcore/bench/vs_transformers.py): seconds per path and phase, speed-ups, and each
of our gradients against its transformers peer. Each path runs twice per point and its second run is
timed (a training loop's steady state; --cold times the first, whose seconds the JSON keeps either
way). The config's memory.host_heap applies to the whole process (bench-hybrid-256.yaml: retain), both
peers alike.

--bubble measures the pipeline bubble (time each stage waits in Megatron's schedules) on CPU ranks, 1F1B
against interleaved stages, beside the planner's figure (longstraw_mcore/bench/bubble.py). --stage-us T
gives each stage a device of its own (every layer also sleeps T us per token forward, 2T backward), so
that PP ranks on fewer cores wait only on the schedule.

--tree WIDTHS:LENGTHS replaces each point's responses by a full prefix tree (widths[d] children per node
at depth d, segments of lengths[d] tokens, the last the responses' own tails; the example: G=16
responses of 64 tokens, 75% of their tokens shared) and runs every mode twice, as a tree
(replay.prefix_tree=true) and flat (false): the FLOPs measured beside the analytic ratio.

Per point: wall seconds per phase, FLOPs measured with torch.utils.flop_counter.FlopCounterMode beside
the analytic count of this algorithm and the no-recompute minimum (longstraw_mcore/planner/flops.py),
peak memory (CUDA: allocator peak; CPU: peak resident-set growth sampled every 2 ms, with glibc
returning freed tensor blocks to the OS, i.e. what the process really took), prompt-state bytes. Naive runs only up to --naive-max-prompt (time,
not memory, limits it on a CPU; say so in the table), on --naive-copies of the G copies if set. Prints a
table and writes JSON. One process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longstraw_mcore.memory import host_heap  # noqa: E402

_LIBC = host_heap.libc()


def _rss_follows_tensors() -> None:
    """M_MMAP_THRESHOLD = 128 KiB, fixed: every tensor-sized block is its own mapping, returned to the OS
    when freed, so resident memory follows the live tensors instead of glibc's retained heap (for the
    peak-memory columns; it costs page faults, so the side-by-side timing leaves it off)."""
    if _LIBC is not None:
        _LIBC.mallopt(host_heap.M_MMAP_THRESHOLD, 128 * 1024)


class RssPeak:
    """Peak resident-set growth of this process while active, sampled every `interval` seconds (the
    CPU memory measure for runs too long for the profiler's memory timeline)."""

    def __init__(self, interval=0.002):
        import psutil

        self.proc, self.interval = psutil.Process(), interval

    def __enter__(self):
        import gc

        gc.collect()
        if _LIBC is not None:
            _LIBC.malloc_trim(0)
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.bytes = self.peak - self.base


def _measure(fn, device):
    import torch

    from longstraw_mcore.bench.flops import flop_counter

    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with RssPeak() as rss, flop_counter() as fc:
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else rss.bytes
    return out, secs, fc.get_total_flops(), int(peak)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/qwen3.6-tiny.yaml")
    p.add_argument("--prompt-lens", default="4096,16384,65536")
    p.add_argument("--response-lens", default="256,1024")
    p.add_argument("--group-sizes", default="2,8")
    p.add_argument("--modes", default="detached,exact")
    p.add_argument("--naive-max-prompt", type=int, default=16384)
    p.add_argument("--naive-max-group", type=int, default=8, help="run naive only for G up to this (time)")
    p.add_argument("--naive-copies", type=int, default=0,
                   help="run naive on only this many of the G copies (0 = all) and scale its FLOPs and seconds by "
                        "G / copies: the copies are identical work (equal R), run one after another")
    p.add_argument("--tree", default="", help="WIDTHS:LENGTHS of a full prefix tree (see above); overrides "
                   "--response-lens and --group-sizes")
    p.add_argument("--skip", default="", help="semicolon-separated P:R:G:mode points to skip (time budget)")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's bf16 peak (TFLOP/s) to report each row's FLOP rate against (0: not reported)")
    p.add_argument("--table-from", default=None, help="print the table of earlier JSON files (comma-separated; "
                   "analytic columns recomputed with the current FLOP model) and exit")
    p.add_argument("--vs-transformers", action="store_true", help="the side-by-side table with transformers (above)")
    p.add_argument("--paths", default="", help="--vs-transformers: the paths to run (comma-separated, of "
                   "longstraw_mcore/bench/vs_transformers.py PATHS; default: all)")
    p.add_argument("--hf-full-copies", type=int, default=0,
                   help="--vs-transformers: run transformers' full sequences on this many of the G branches and "
                        "scale (0 = all; its gradient is compared only when all run)")
    p.add_argument("--cold", action="store_true", help="--vs-transformers: time each path's first run at a "
                   "point (default: its second, the steady state of a training loop; the first is kept in the JSON)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--bubble", default="", help="PP:VPP,... points: the pipeline bubble measured on CPU ranks "
                   "beside the planner's (longstraw_mcore/bench/bubble.py), at the first --prompt-lens, "
                   "--response-lens and --group-sizes, exact mode")
    p.add_argument("--chunk-len", type=int, default=256, help="--bubble: replay.chunk_len (the capture's micro-batches)")
    p.add_argument("--stage-us", type=float, default=0.0, help="--bubble: emulated device time per layer and "
                   "token (forward; backward 2x), slept, so each stage runs as on its own device (0: off)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from longstraw_mcore.cli import quiet_expected_warnings

    quiet_expected_warnings()  # (the CLI's: Megatron's absent-TE/apex notes and the like)
    if a.vs_transformers:
        return vs_transformers(a)
    if a.bubble:
        return bubble(a)
    _rss_follows_tensors()
    if a.table_from:
        return print_table(a.table_from, a.config, a.overrides)

    import torch

    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.flops import naive_flops, step_flops
    from longstraw_mcore.bench.trees import full_tree
    from longstraw_mcore.replay.engine import replay_pieces, stores_attention_probs
    from longstraw_mcore.replay.plan import micro_steps
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    cfg = load_config(a.config, a.overrides)
    if cfg.resolved_device() == "cpu" and not any(o.startswith("ops.attention=") for o in a.overrides):
        # FlopCounterMode has no formula for torch's fused CPU attention op (what ops.attention=auto takes
        # on CPU): the FLOP columns measure the plain twin unless told otherwise
        cfg = load_config(a.config, [*a.overrides, "ops.attention=plain"])
        print("(CPU: ops.attention=plain, as FlopCounterMode does not count the fused CPU attention op; pass "
              "ops.attention=auto to time that op, its FLOP columns then leave the attention out)", flush=True)
    if cfg.memory.host_heap != "system":
        raise SystemExit(f"memory.host_heap={cfg.memory.host_heap}: this table's peak-memory columns follow "
                         "resident memory as tensors are freed, which a retained heap hides; use system here "
                         "(--vs-transformers takes retain: it measures time only)")
    par = setup_parallel(cfg)
    m = cfg.model
    from longstraw_mcore.ops.dispatch import configure

    configure(cfg.ops)  # ops.attention=plain|flash compares kernels; auto: flash on CUDA bf16
    family = get_family(m.family)
    model = family.build_model(m, par, cfg.resolved_device())
    from longstraw_mcore.memory.layers import apply

    apply(model, cfg.memory)  # the memory switches of the overrides (config/memory.py)
    skip = set(filter(None, a.skip.split(";")))
    rows = []
    gen = torch.Generator().manual_seed(0)
    tree = None
    if a.tree:
        widths, lengths = ([int(x) for x in part.split(",")] for part in a.tree.split(":"))
        if len(widths) != len(lengths) or min(widths + lengths) < 1:
            raise SystemExit(f"--tree {a.tree}: WIDTHS:LENGTHS, as many positive widths as lengths")
        tree = (widths, lengths)
        a.response_lens, a.group_sizes = str(sum(lengths)), str(_prod(widths))
    for P in map(int, a.prompt_lens.split(",")):
        prompt = torch.randint(0, m.vocab_size, (P,), generator=gen).tolist()
        for R in map(int, a.response_lens.split(",")):
            for G in map(int, a.group_sizes.split(",")):
                responses = (full_tree(m.vocab_size, *tree, gen) if tree else
                             [torch.randint(0, m.vocab_size, (R,), generator=gen).tolist() for _ in range(G)])
                group = RolloutGroup(prompt=prompt, responses=responses, rewards=[float(i % 3) for i in range(G)])
                naive = None
                for mode, as_tree in [(mo, t) for mo in a.modes.split(",") for t in ((True, False) if tree else (None,))]:
                    if f"{P}:{R}:{G}:{mode}" in skip:
                        continue
                    rcfg = type(cfg.replay)(**{**cfg.replay.__dict__, "mode": mode})
                    if as_tree is not None:
                        rcfg = type(cfg.replay)(**{**rcfg.__dict__, "prefix_tree": as_tree})
                    model.zero_grad(set_to_none=True)
                    st, secs, flops, peak = _measure(lambda: process_group(model, group, rcfg, cfg.grpo),
                                                     par.device)
                    widest = max(b - a for a, b in micro_steps([R] * G, rcfg.batch_tokens))
                    store = stores_attention_probs(model, P - 1, rcfg, widest, R)
                    an = step_flops(family.layers, m, P, replay_pieces(model, responses, rcfg), mode, rcfg.chunk_len,
                                    par.tp, store_probs=store, batch_tokens=rcfg.batch_tokens)
                    if naive is None and P <= a.naive_max_prompt and G <= a.naive_max_group:
                        fn = group_loss_fn(group, cfg.grpo, advantages(group.rewards, cfg.grpo))
                        copies = a.naive_copies if 0 < a.naive_copies < G else G
                        model.zero_grad(set_to_none=True)
                        _, nsecs, nflops, npeak = _measure(
                            lambda: full_sequence_branches(model, prompt, responses[:copies], fn, rcfg.logprob_chunk),
                            par.device)
                        naive = {"seconds": nsecs * G / copies, "flops": nflops * G // copies, "peak_bytes": npeak,
                                 "copies_run": copies, "measured_flops_of_copies_run": nflops}
                    nan = naive_flops(family.layers, m, P, [R] * G, par.tp)
                    row = {"P": P, "R": R, "G": G, "mode": mode, "chunk_len": rcfg.chunk_len, "tree": as_tree,
                           "batch_tokens": rcfg.batch_tokens,
                           "replayed_tokens": st.replayed_tokens, "response_tokens": st.tokens,
                           "attn_probs_budget_mib": rcfg.attn_probs_budget_mib, "store_probs": store,
                           "seconds": secs, "phase_seconds": st.seconds,
                           "tokens_per_s": {"capture": (P - 1) / max(st.seconds.get("capture", 1e-9), 1e-9),
                                            "replay": G * R / max(st.seconds.get("replay", 1e-9), 1e-9)},
                           "flops_measured": flops, "flops_algorithm": an["algorithm"], "flops_minimum": an["minimum"],
                           "tflops_per_s": flops / secs / 1e12,
                           "fraction_of_peak": (flops / secs / 1e12 / a.peak_tflops) if a.peak_tflops else None,
                           "measured_over_minimum": flops / an["minimum"]["total"],
                           "measured_over_algorithm": flops / an["algorithm"]["total"],
                           "peak_bytes": peak, "state_bytes": st.state_bytes, "naive": naive,
                           "naive_flops_analytic": nan,
                           "analytic_ratio_naive_over_replay": nan["minimum"] / an["minimum"]["total"],
                           "measured_ratio_naive_over_replay": (naive["flops"] / flops) if naive else None}
                    rows.append(row)
                    print(_fmt(row), flush=True)
                    if as_tree is False:  # the flat run of the same group: the tree's measured and analytic ratios
                        tr = rows[-2]
                        tr["flat_over_tree"] = {"measured": flops / tr["flops_measured"],
                                                "algorithm": an["algorithm"]["total"] / tr["flops_algorithm"]["total"],
                                                "seconds": secs / tr["seconds"]}
                        print(f"  tree vs flat ({tr['replayed_tokens']} of {tr['response_tokens']} response tokens "
                              f"replayed): flat/tree FLOPs measured {tr['flat_over_tree']['measured']:.3f}, analytic "
                              f"{tr['flat_over_tree']['algorithm']:.3f}; seconds {tr['flat_over_tree']['seconds']:.2f}",
                              flush=True)
                    with open(a.out, "w") as f:
                        json.dump({"config": a.config, "device": str(par.device), "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


def bubble(a) -> int:
    import dataclasses

    from longstraw_mcore.bench import bubble as bb
    from longstraw_mcore.config import load_config

    m = load_config(a.config, a.overrides).model
    if m.family != "qwen3_5":
        raise SystemExit(f"--bubble: model.family={m.family!r}; the bubble bench builds the qwen3_5 family")
    try:
        points = [tuple(int(x) for x in pt.split(":")) for pt in a.bubble.split(",")]
        assert all(len(pt) == 2 and pt[0] > 1 and pt[1] >= 1 for pt in points)
    except (ValueError, AssertionError):
        raise SystemExit(f"--bubble {a.bubble}: comma-separated PP:VPP points, PP > 1, VPP >= 1 (e.g. 2:1,2:2)")
    P, R, G = (int(x.split(",")[0]) for x in (a.prompt_lens, a.response_lens, a.group_sizes))
    print(f"bubble: {m.num_layers} layers, hidden {m.hidden_size}, {m.dtype}; P={P:,} in chunks of {a.chunk_len}, "
          f"G={G} x R={R}, exact mode, one branch per micro-step; {os.cpu_count()} cores"
          + (f"; each stage's device emulated: {a.stage_us:g} us per layer and token forward, 2x backward"
             if a.stage_us > 0 else ""), flush=True)
    from longstraw_mcore.families import get_family

    if a.stage_us < 0:
        raise SystemExit(f"--stage-us {a.stage_us:g}: microseconds per layer and token, >= 0 (0: off)")
    rows = bb.measure(get_family, points, dataclasses.asdict(m), P, R, G, a.chunk_len, stage_us=a.stage_us)
    print(bb.table(rows))
    with open(a.out, "w") as f:
        json.dump({"inputs": {"config": a.config, "overrides": a.overrides, "P": P, "R": R, "G": G,
                              "chunk_len": a.chunk_len, "stage_us": a.stage_us}, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


def vs_transformers(a) -> int:
    import torch

    from longstraw_mcore.bench import vs_transformers as vt
    from longstraw_mcore.config import load_config
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families import get_family
    from longstraw_mcore.ops.dispatch import configure
    from longstraw_mcore.parallel.groups import setup_parallel

    if a.threads:
        torch.set_num_threads(a.threads)
    config = a.config if a.config != "configs/qwen3.6-tiny.yaml" else "configs/bench-hybrid-256.yaml"
    cfg = load_config(config, a.overrides)
    m = cfg.model
    if m.family != "qwen3_5":
        raise SystemExit(f"--vs-transformers: model.family={m.family!r}; the side-by-side runs the qwen3_5 family")
    paths = tuple(a.paths.split(",")) if a.paths else vt.PATHS
    if not set(paths) <= set(vt.PATHS):
        raise SystemExit(f"--paths {a.paths}: each one of {', '.join(vt.PATHS)}")
    par = setup_parallel(cfg)
    configure(cfg.ops)
    host_heap.apply(cfg.memory.host_heap)  # (process-wide: transformers' paths run under it too)
    if cfg.replay.batch_tokens == 0:
        print("(replay.batch_tokens=0: the batched columns are one branch per micro-step too)", flush=True)
    model = get_family(m.family).build_model(m, par, cfg.resolved_device())
    from longstraw_mcore.bench.hf_kernels import fast_path

    hf_fla = fast_path(par.device.type)  # transformers with its own fast path where it has one
    hf = vt.build_hf(m, fla=hf_fla).to(par.device)
    vt.load_same_weights(model, hf, m)
    gen = torch.Generator().manual_seed(0)
    rows = []
    warm = RolloutGroup(prompt=list(range(1, 65)), responses=[[1] * 8, [2] * 8], rewards=[0.0, 1.0])
    vt.run_point(model, hf, m, warm, cfg.replay, cfg.grpo, warm=False, progress=lambda s: None)  # first calls' set-up, untimed
    for P in map(int, a.prompt_lens.split(",")):
        prompt = torch.randint(0, m.vocab_size, (P,), generator=gen).tolist()
        for R in map(int, a.response_lens.split(",")):
            for G in map(int, a.group_sizes.split(",")):
                responses = [torch.randint(0, m.vocab_size, (R,), generator=gen).tolist() for _ in range(G)]
                group = RolloutGroup(prompt=prompt, responses=responses, rewards=[float(i % 3) for i in range(G)])
                print(f"P={P} R={R} G={G} ({m.dtype}, {torch.get_num_threads()} threads, ops.attention="
                      f"{cfg.ops.attention}, ops.gdn={cfg.ops.gdn}, memory.host_heap={host_heap.applied()}, batched: "
                      f"replay.batch_tokens={cfg.replay.batch_tokens}):", flush=True)
                res = vt.run_point(model, hf, m, group, cfg.replay, cfg.grpo, paths=paths, copies=a.hf_full_copies,
                                   warm=not a.cold,
                                   progress=lambda s: print(s, flush=True))
                rows.append({"P": P, "R": R, "G": G, "batch_tokens": cfg.replay.batch_tokens, "paths": res})
                if len(rows) == 1 or rows[-2]["P"] != P:  # the GDN kernels alone, once per prompt length
                    kern = vt.gdn_kernels(m, P, device=par.device.type)
                    rows[-1]["gdn_kernels"] = kern
                    print("  Gated DeltaNet rule, one layer, {} tokens: ours {:,.0f} / {:,.0f} tok/s, transformers' "
                          "torch rule {:,.0f} / {:,.0f} tok/s (no autograd / forward+backward); max |diff| {:.1e}".format(
                              P, kern["ours"]["forward_tokens_per_s"], kern["ours"]["forward_backward_tokens_per_s"],
                              kern["transformers"]["forward_tokens_per_s"],
                              kern["transformers"]["forward_backward_tokens_per_s"], kern["max_abs_diff"]), flush=True)
                with open(a.out, "w") as f:
                    json.dump({"config": config, "device": str(par.device), "dtype": m.dtype,
                               "transformers_gdn_rule": "fla" if hf_fla else "torch",
                               "host_heap": host_heap.applied(), "threads": torch.get_num_threads(),
                               "overrides": a.overrides, "rows": rows}, f, indent=1)
    print(vs_table(rows))
    print(f"wrote {a.out}")
    return 0


def vs_table(rows) -> str:
    """The side-by-side table: seconds per path (ours with its phases), and the acceptance ratios."""
    budgets = sorted({r.get("batch_tokens", "?") for r in rows}, key=str)
    out = [f"(detached, exact: one branch per micro-step; batched: replay.batch_tokens={', '.join(map(str, budgets))}; "
           "ratios: unbatched / batched)",
           "| P | R | G | transformers full seq. | transformers cache | detached (capture + replay) | "
           "exact (+ prompt bwd) | detached, batched | exact, batched | detached vs cache | exact vs full seq. | "
           "exact / detached | exact / detached, first runs | grad vs peer (det., exact) |", "|" + "---|" * 14]
    for r in rows:
        p = r["paths"]
        s = {k: v["seconds"] for k, v in p.items()}
        ph = lambda k, *names: " + ".join(f"{p[k]['phases'].get(n, 0.0):.2f}" for n in names)  # noqa: E731
        cell = lambda k, *names: (f"{s[k]:.2f} ({ph(k, *names)})" if k in s else "-")  # noqa: E731
        ratio = lambda a, b, fmt: (fmt.format(s[a] / s[b]) if a in s and b in s else "-")  # noqa: E731
        scaled = f" (x{r['G'] // p['hf_full']['copies_run']})" if "copies_run" in p.get("hf_full", {}) else ""
        gr = lambda k: (f"{p[k]['grad_rel_to_peer']['worst_rel']:.1e}" if "grad_rel_to_peer" in p.get(k, {}) else "-")  # noqa: E731
        both = lambda f, a, b: f"{f(a)} / {f(b)}" if b in s else f(a)  # noqa: E731
        cold = lambda a, b: (f"{p[a]['cold_seconds'] / p[b]['cold_seconds']:.2f}x"  # noqa: E731
                             if "cold_seconds" in p.get(a, {}) and "cold_seconds" in p.get(b, {}) else "-")
        out.append(f"| {r['P']} | {r['R']} | {r['G']} | " + (f"{s['hf_full']:.1f}{scaled}" if "hf_full" in s else "-")
                   + " | " + (f"{s['hf_cache']:.2f} ({ph('hf_cache', 'prompt', 'branches')})" if "hf_cache" in s else "-")
                   + f" | {cell('detached', 'capture', 'replay')} | {cell('exact', 'capture', 'replay', 'prompt_backward')}"
                   f" | {cell('detached_batched', 'capture', 'replay')} | {cell('exact_batched', 'capture', 'replay', 'prompt_backward')}"
                   f" | {both(lambda k: ratio('hf_cache', k, '{:.2f}x'), 'detached', 'detached_batched')}"
                   f" | {both(lambda k: ratio('hf_full', k, '{:.1f}x'), 'exact', 'exact_batched')}"
                   f" | {ratio('exact', 'detached', '{:.2f}x')}" + (f" / {ratio('exact_batched', 'detached_batched', '{:.2f}x')}"
                                                                   if "exact_batched" in s else "")
                   + f" | {cold('exact', 'detached')}" + (f" / {cold('exact_batched', 'detached_batched')}"
                                                           if "exact_batched" in s else "")
                   + f" | {gr('detached')}, {gr('exact')} |")
    return "\n".join(out)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def print_table(path: str, config: str, overrides) -> int:
    from longstraw_mcore.config import load_config
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.flops import naive_flops, step_flops

    m = load_config(config, overrides).model
    layers = get_family(m.family).layers
    rows = [r for p in path.split(",") for r in json.load(open(p))["rows"]]
    # naive does not depend on the replay mode: a row without it shows the naive run of another row at
    # the same (P, R, G), if one was measured
    naive_at = {(r["P"], r["R"], r["G"]): r["naive"] for r in rows if r["naive"]}
    rows = [{**r, "naive": r["naive"] or naive_at.get((r["P"], r["R"], r["G"]))} for r in rows]
    rows.sort(key=lambda r: (r["P"], r["R"], r["G"], r["mode"], r.get("store_probs", False)))
    print("| P | R | G | mode | attention bwd | s | capture tok/s | replay tok/s | measured TF | /algorithm | /minimum "
          "| /3x model | peak MiB | state MiB | naive TF (s) | naive/replay measured | naive/replay analytic |")
    print("|" + "---|" * 17)
    for r in rows:
        store = r.get("store_probs", False)
        an = step_flops(layers, m, r["P"], [r["R"]] * r["G"], r["mode"], r.get("chunk_len", 4096), store_probs=store,
                        batch_tokens=r.get("batch_tokens", 0))  # (rows before replay.batch_tokens: one branch each)
        nv = naive_flops(layers, m, r["P"], [r["R"]] * r["G"])
        f = r["flops_measured"]
        naive = r["naive"]
        copies = naive.get("copies_run", r["G"]) if naive else r["G"]
        scaled = "" if copies == r["G"] else f"; {copies} of {r['G']} copies run, x{r['G'] // copies}"
        print(f"| {r['P']} | {r['R']} | {r['G']} | {r['mode']} | {'stored' if store else 'recompute'} | {r['seconds']:.1f} | "
              f"{r['tokens_per_s']['capture']:,.0f} | {r['tokens_per_s']['replay']:,.0f} | {f / 1e12:.4f} | "
              f"{f / an['algorithm']['total']:.3f} | {f / an['minimum']['total']:.3f} | {f / an['model_3x']['total']:.3f} | "
              f"{r['peak_bytes'] / 2**20:.1f} | {r['state_bytes'] / 2**20:.2f} | "
              + (f"{naive['flops'] / 1e12:.4f} ({naive['seconds']:.0f}{scaled}) | {naive['flops'] / f:.2f}"
                 if naive else "skipped | -")
              + f" | {nv['minimum'] / an['minimum']['total']:.2f} |")
    return 0


def _fmt(r) -> str:
    nv = r["naive"]
    naive = (f"naive {nv['flops'] / 1e12:.3f} TF {nv['seconds']:.1f}s peak {nv['peak_bytes'] / 2**20:.0f}MiB, "
             f"ratio meas {r['measured_ratio_naive_over_replay']:.2f}") if nv else "naive skipped (time)"
    ratios = (f"(algo {r['measured_over_algorithm']:.3f}x, min {r['measured_over_minimum']:.3f}x) "
              if r["measured_over_algorithm"] else "")
    analytic = (f", analytic ratio {r['analytic_ratio_naive_over_replay']:.2f}"
                if r["analytic_ratio_naive_over_replay"] else "")
    shape = {True: " tree", False: " flat"}.get(r.get("tree"), "")
    return (f"P={r['P']:>6} R={r['R']:>5} G={r['G']} {r['mode']:>8}{shape}: {r['seconds']:7.1f}s "
            f"{'stored' if r['store_probs'] else 'recompute'} {r['flops_measured'] / 1e12:7.3f} TF "
            f"{ratios}peak {r['peak_bytes'] / 2**20:7.1f}MiB "
            f"state {r['state_bytes'] / 2**20:.2f}MiB, {r['tflops_per_s']:.3g} TFLOP/s"
            + (f" ({100 * r['fraction_of_peak']:.1f}% of peak)" if r.get("fraction_of_peak") else "")
            + f" | {naive}{analytic}")


if __name__ == "__main__":
    sys.exit(main())
