#!/usr/bin/env python
"""Context-parallel capture, per rank: wall seconds, the part spent in the Gated DeltaNet core and in
attention, and every collective (count, bytes, seconds), at CP=1 and CP=n on local gloo ranks.

  python tools/bench_cp.py [--config configs/qwen3.6-tiny.yaml] [--prompt-len 4096] [--chunk-len 1024]
      [--cp 2] [--out bench_cp.json] [key=value ...]

What it shows: under CP every rank runs the GDN core on the whole chunk for 1/n of the heads at the
same time as the others (no rank waits for another's recurrent state), so each rank's GDN seconds
are about 1/n of the single rank's; the collectives are all-to-alls (tokens to heads and back),
all-gathers (the chunk's Q/K/V) and all-reduces (the log-sum-exp merge), whose bytes per chunk
depend on the chunk, not on the prompt length. Bytes are what a rank receives from the others (`received`: the wire
traffic; an all-to-all head exchange receives 1/n of what an all-gather of the tokens would). On a
2-core CPU the n ranks share the cores: compare seconds of compute per rank, not the wall time.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank, world_size, config, overrides, P, chunk, cp):
    import torch
    import torch.distributed as dist

    from longstraw_mcore.config import load_config
    from longstraw_mcore.families import get_family
    from longstraw_mcore.models.mixers import gated_deltanet
    from longstraw_mcore.parallel import cp_attention
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.prompt_state import hooks
    from longstraw_mcore.replay.engine import capture

    cfg = load_config(config, list(overrides) + [f"parallel.cp={cp}", "device=cpu"])
    par = setup_parallel(cfg)
    model = get_family(cfg.model.family).build_model(cfg.model, par, "cpu")
    clock = {"gdn_core": 0.0, "attention": 0.0}
    comm: dict[str, list] = {}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[name] += time.perf_counter() - t
        return call

    def received(name, a, k) -> int:
        """Bytes this rank receives from the others (what crosses the wire to it): an all-gather n-1
        shares, an all-to-all what the others send here, a ring all-reduce 2(n-1)/n of the tensor, a
        reduce-scatter (n-1)/n of its input."""
        group = k.get("group")
        n = dist.get_world_size(group)
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        if name == "all_to_all_single":
            recv, sizes = a[0], a[2]
            own = sizes[dist.get_rank(group)] if sizes else recv.numel() // n
            return (recv.numel() - own) * recv.element_size()
        x = a[1] if name != "all_reduce" else a[0]
        return {"all_gather": (n - 1) * size(x), "all_gather_into_tensor": (n - 1) * size(x),
                "all_reduce": 2 * (n - 1) * size(x) // n, "reduce_scatter_tensor": (n - 1) * size(x) // n}[name]

    def counted(name, fn):
        def call(*a, **k):
            nbytes = received(name, a, k)
            t = time.perf_counter()
            out = fn(*a, **k)
            rec = comm.setdefault(name, [0, 0, 0.0])
            rec[0] += 1
            rec[1] += nbytes
            rec[2] += time.perf_counter() - t
            return out
        return call

    gated_deltanet.GatedDeltaNetMixer._core = timed("gdn_core", gated_deltanet.GatedDeltaNetMixer._core)
    cp_attention.chunk_attention = timed("attention", cp_attention.chunk_attention)  # CP > 1
    hooks.attention = timed("attention", hooks.attention)                            # CP = 1
    for name in ("all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        setattr(dist, name, counted(name, getattr(dist, name)))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, P - 1), generator=torch.Generator().manual_seed(0))
    from longstraw_mcore.bench.memory import measure_memory

    dist.barrier()
    t = time.perf_counter()
    st = capture(model, prompt, type(cfg.replay)(chunk_len=chunk))
    wall = time.perf_counter() - t
    timed_clock, timed_comm = dict(clock), {k: list(v) for k, v in comm.items()}  # the memory run is not timed
    dist.barrier()
    _, peak, _, how = measure_memory(lambda: capture(model, prompt, type(cfg.replay)(chunk_len=chunk)), par.device)
    return {"rank": rank, "cp": cp, "wall_s": wall, "peak_bytes": peak, "peak_how": how,
            **{f"{k}_s": v for k, v in timed_clock.items()},
            "collectives": {k: {"calls": v[0], "bytes": v[1], "seconds": v[2]} for k, v in timed_comm.items()},
            "state_bytes": st.nbytes_by_type()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/qwen3.6-tiny.yaml")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--chunk-len", type=int, default=1024)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--out", default="bench_cp.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from longstraw_mcore.launch_local import run_ranks

    rows = []
    for cp in (1, a.cp):
        rows += run_ranks(_worker, cp, a.config, a.overrides, a.prompt_len, a.chunk_len, cp, timeout_s=3600)
    print(f"capture of P={a.prompt_len} in chunks of {a.chunk_len} ({a.config}); seconds per rank")
    print("| CP | rank | wall s | GDN core s | attention s | collectives (calls, MiB, s) | attention K/V MiB | GDN state MiB "
          "| capture peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        coll = "; ".join(f"{k} {v['calls']}, {v['bytes'] / 2**20:.2f}, {v['seconds']:.2f}" for k, v in
                         sorted(r["collectives"].items())) or "-"
        sb = r["state_bytes"]
        print(f"| {r['cp']} | {r['rank']} | {r['wall_s']:.2f} | {r['gdn_core_s']:.2f} | {r['attention_s']:.2f} | {coll} | "
              f"{sb['attention_kv'] / 2**20:.3f} | {(sb['gdn_state'] + sb['gdn_chunk_boundaries']) / 2**20:.3f} | "
              f"{r['peak_bytes'] / 2**20:.1f} |")
    with open(a.out, "w") as f:
        json.dump({"config": a.config, "prompt_len": a.prompt_len, "chunk_len": a.chunk_len, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
