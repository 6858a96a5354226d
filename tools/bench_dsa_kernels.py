#!/usr/bin/env python
"""The DSA kernels against their twins, one op at a time: a replayed branch's sparse MLA (forward and
backward) and indexer top-k over a prompt state of S rows, peak bytes and seconds side by side.

  PYTHONPATH=. python tools/bench_dsa_kernels.py [--rows 65536] [--queries 8] [--topk 64] [--heads 16]
      [--latent 512] [--rope 64] [--index-heads 32] [--index-dim 128] [--dtype float32] [--device cpu]
      [--ops mla,indexer] [--out bench_dsa_kernels.json]

The state and the branch's own rows come as the prompt state hands them over (prompt_state/mla.py): a
(state, own) pair, the state batch 1 without a gradient (detached mode), the branch's rows with one.
The twins (ops/dsa.py) join them and gather; the kernels (ops/dsa_triton_*.py) read them in place. Peak:
CUDA's allocator peak above what was allocated before the op, or on the CPU PyTorch's profiler over
every tensor allocation (bench/memory.measure_memory). Seconds mean nothing on the CPU, where the kernels
run under Triton's interpreter (set TRITON_INTERPRET=1 before starting); the bytes do. There the
indexer kernel is impractical beyond a few thousand keys (the interpreter's tl.sort: 4.5 minutes for
16K keys and 4 queries), so run `--ops mla` on the CPU. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("rows", 65536), ("queries", 8), ("topk", 64), ("heads", 16), ("latent", 512), ("rope", 64),
                          ("index-heads", 32), ("index-dim", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--ops", default="mla,indexer", help="comma-separated: mla, indexer")
    p.add_argument("--out", default="bench_dsa_kernels.json")
    a = p.parse_args(argv)
    import torch

    from longstraw_mcore.bench.memory import measure_memory
    from longstraw_mcore.ops import dsa, dsa_triton_indexer, dsa_triton_mla, triton_interpret

    if a.device == "cpu" and not triton_interpret.active():
        p.error("the kernels run on the CPU only under Triton's interpreter: start with TRITON_INTERPRET=1")
    triton_interpret.install()
    dt, dev = getattr(torch, a.dtype), a.device
    g = torch.Generator().manual_seed(0)
    S, T, k, H, R, Dr = a.rows, a.queries, a.topk, a.heads, a.latent, a.rope
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
    state_c, state_pe, state_ik = mk(1, S, R), mk(1, S, Dr), mk(1, S, a.index_dim)
    own_c, own_pe, own_ik = mk(1, T, R), mk(1, T, Dr), mk(1, T, a.index_dim)
    qn, qp, wuk = mk(1, T, H, 128), mk(1, T, H, Dr), mk(H, 128, R) * 0.1
    qi, wi = mk(1, T, a.index_heads, a.index_dim), mk(1, T, a.index_heads)
    q_pos, k_pos = torch.arange(S, S + T, device=dev), torch.arange(S + T, device=dev)

    sel, _ = dsa.indexer_topk(qi, (state_ik, own_ik), wi, q_pos, k_pos, k)
    valid = torch.ones_like(sel, dtype=torch.bool)

    def attention(mod):
        own = [x.clone().requires_grad_(True) for x in (own_c, own_pe, qn, qp)]
        o, _ = mod.mla_sparse_partial(own[2], own[3], (state_c, own[0]), (state_pe, own[1]), wuk, sel, valid, 0.1)
        o.float().sum().backward()

    def indexer(mod):
        mod.indexer_topk(qi, (state_ik, own_ik), wi, q_pos, k_pos, k)

    rows = []
    ops = [(op, fn) for key, op, fn in (("mla", "sparse MLA fwd+bwd", attention), ("indexer", "indexer top-k", indexer))
           if key in a.ops.split(",")]
    for op, fn in ops:
        for name, mod in (("twin", dsa), ("kernel", dsa_triton_mla if fn is attention else dsa_triton_indexer)):
            fn(mod)  # warm (compiles on CUDA)
            t0 = time.perf_counter()
            _, peak, _, how = measure_memory(lambda: fn(mod), torch.device(dev))
            if dev == "cuda":
                torch.cuda.synchronize()
            rows.append({"op": op, "path": name, "peak_bytes": int(peak), "seconds": time.perf_counter() - t0,
                         "how": how})
    state_bytes = S * (R + Dr + a.index_dim) * state_c.element_size()
    print(f"state: {S:,} rows, {state_bytes / 2**20:,.1f} MiB (latent {R}, RoPE {Dr}, index key {a.index_dim}, "
          f"{a.dtype}); branch: {T} tokens, top-k {k}, {H} heads, {dev}")
    print("| op | path | peak MiB | seconds |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['path']} | {r['peak_bytes'] / 2**20:,.2f} | {r['seconds']:.2f} |")
    with open(a.out + ".tmp", "w") as f:
        json.dump({"args": vars(a), "state_bytes": state_bytes, "rows": rows,
                   "interpreter": triton_interpret.active()}, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
