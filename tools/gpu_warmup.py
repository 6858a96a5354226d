"""Compile (and autotune) every Triton path the GPU check's later steps take, at their shapes and dtypes,
once, so that those steps time steady-state work and their limits hold: flash-linear-attention's gated
delta rule (forward and backward with an initial state and a gradient into the final state, as exact mode
runs it) and its causal conv, and the project's DSA kernels (indexer scores, sparse MLA forward and
backward). Triton keeps what it compiles, and fla the configs its autotuner chose, in Triton's cache
directory, which the later processes read. Prints one line per path and writes JSON {path: seconds}.

The first GPU check on an H200 (bench_results/h200_gpu_check_20261205) had no such step: the first
process to touch fla (a 2-layer model) spent its whole 50 s limit there, and every step that took fla or
the DSA kernels at GLM-5.2's shapes ran out of time.

    python tools/gpu_warmup.py --out warmup.json [--only fla|dsa] [--device cuda]
(On the CPU, under TRITON_INTERPRET=1 and at tiny shapes with --tiny: the rehearsal of this script.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, key heads, value heads, key dim, value dim, dtype, conv channels) as the later steps run them
GDN_CASES = [("qwen3.6-27b bf16 (ladder)", 16, 48, 128, 128, torch.bfloat16, 2 * 16 * 128 + 48 * 128),
             ("tiny K=128 fp32 (validate_fla)", 2, 4, 128, 128, torch.float32, 2 * 2 * 128 + 4 * 128),
             ("qwen3.6-27b fp32 (kernels)", 16, 48, 128, 128, torch.float32, 2 * 16 * 128 + 48 * 128),
             ("bench-hybrid-256 K=128 bf16 (vs_transformers)", 4, 8, 128, 128, torch.bfloat16, 2 * 4 * 128 + 8 * 128)]
# (label, indexer heads, indexer dim, top-k, heads, latent, nope dim, rope dim, dtype)
DSA_CASES = [("glm-5.2 bf16 (glm ladder)", 32, 128, 2048, 64, 512, 192, 64, torch.bfloat16),
             ("glm-5.2 fp32", 32, 128, 2048, 64, 512, 192, 64, torch.float32)]
TINY_GDN = [("tiny fp32", 2, 4, 16, 16, torch.float32, 2 * 2 * 16 + 4 * 16)]
TINY_DSA = [("tiny fp32", 4, 8, 8, 4, 12, 6, 4, torch.float32)]


def _timed(fn, dev) -> float:
    t0 = time.perf_counter()
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def gdn_path(hk, hv, dk, dv, dt, ch, dev, T=192) -> None:
    from longstraw_mcore.ops import fla_gdn

    g = torch.Generator().manual_seed(0)
    mk = lambda *s, d=dt: torch.randn(*s, generator=g).to(dev, d).requires_grad_()  # noqa: E731
    q, k, v = mk(1, T, hk, dk), mk(1, T, hk, dk), mk(1, T, hv, dv)
    gate = (-torch.rand(1, T, hv, generator=g)).to(dev).requires_grad_()
    beta = torch.rand(1, T, hv, generator=g).to(dev, dt).requires_grad_()
    h0 = mk(1, hv, dk, dv, d=torch.float32)
    o, final = fla_gdn.chunk_gated_delta_rule(q, k, v, gate, beta, h0)
    (o.float().square().sum() + final.square().sum()).backward()
    x, w = mk(1, T, ch), mk(ch, 4)
    state = mk(1, ch, 3)
    y, s = fla_gdn.causal_conv1d(x, w, state, "silu")
    (y.float().square().sum() + s.float().square().sum()).backward()


def dsa_path(hi, di, topk, h, r, dn, dr, dt, dev, T=64) -> None:
    from longstraw_mcore.ops import dsa_triton_indexer, dsa_triton_mla

    g = torch.Generator().manual_seed(1)
    S = 2 * topk + 5
    mk = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
    q_pos, k_pos = torch.arange(S - T, S, device=dev), torch.arange(S, device=dev)
    rows, vals = dsa_triton_indexer.indexer_topk(mk(1, T, hi, di), mk(1, S, di), mk(1, T, hi) * hi ** -0.5, q_pos,
                                                 k_pos, topk)
    x = {n: t.requires_grad_() for n, t in dict(qn=mk(1, T, h, dn), qp=mk(1, T, h, dr), c=mk(1, S, r),
                                                pe=mk(1, S, dr), wuk=mk(h, dn, r) * dn ** -0.5).items()}
    o, lse = dsa_triton_mla.mla_sparse_partial(x["qn"], x["qp"], x["c"], x["pe"], x["wuk"], rows, vals > float("-inf"),
                                               (dn + dr) ** -0.5)
    (o.float().square().sum() + lse.sum()).backward()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=("fla", "dsa"), default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU rehearsal under the interpreter)")
    a = ap.parse_args(argv)
    res: dict[str, float] = {}
    gdn, dsa = (TINY_GDN, TINY_DSA) if a.tiny else (GDN_CASES, DSA_CASES)
    # the DSA kernels first: a few kernels without autotuning, quick; then fla's, most used first
    todo = ([("dsa " + c[0], dsa_path, c[1:]) for c in dsa] if a.only in (None, "dsa") else []) + \
           ([("fla " + c[0], gdn_path, c[1:]) for c in gdn] if a.only in (None, "fla") else [])
    for label, fn, args in todo:
        first = _timed(lambda: fn(*args, a.device), a.device)
        again = _timed(lambda: fn(*args, a.device), a.device)
        res[label] = {"first_s": round(first, 2), "again_s": round(again, 3)}
        print(f"[warmup] {label}: first call {first:.1f} s (compile + autotune), again {again * 1e3:.0f} ms",
              flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))  # after each path: a timeout keeps what was done
    return 0


if __name__ == "__main__":
    sys.exit(main())
