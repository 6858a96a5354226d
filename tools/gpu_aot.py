#!/usr/bin/env python
"""Build, on a CPU machine with no GPU, the Hopper (sm_90) Triton kernels the GPU check takes, and pack them for
the device (issue 58). Run through `scripts/gpu_aot.sh`, which makes the venv of the device's exact wheels.

  python tools/gpu_aot.py OUT [--mode full|pinned|auto] [--only REGEX] [--winners DIR] [--jobs 2] [--cache DIR]

Each path below is the project's own call (`ops.fla_gdn`, `ops.fla_kda`, the DSA kernels, and fla's rule as
transformers calls it) at the shapes and dtypes of a GPU-check step, run on CPU tensors under
`ops.triton_aot.OfflineHopper`: kernels compile into the cache, nothing launches. Modes: `full` compiles every
config each autotuner keeps (the device only benchmarks them, and brings the winners back); `pinned` one
config per kernel and key (the device's winners from `--winners`, else the first kept) with Triton's autotune
record beside it (the device neither compiles nor benchmarks); `auto` (default) is pinned when winners exist
(`--winners`, or the newest `bench_results/*_autotune/`), else full.

Writes OUT/triton-sm90.tar.xz (manifest + cache), OUT/manifest.json and OUT/aot.json (per path: compiles, cache
hits, compile seconds, CPU seconds; totals; sizes). The cache is built at `--cache` (default
`ops.triton_cache.FIXED_CACHE_DIR`, the path the device unpacks to), emptied first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

# name -> (kind, args). GDN: (key heads, value heads, key dim, value dim, dtype, conv channels, initial state,
# transformers' call); DSA: gpu_warmup.dsa_path's; KDA: (heads, K, V, dtype, lower bound or None).
_GDN_27B = (16, 48, 128, 128)
PATHS: dict[str, tuple[str, tuple]] = {
    "gdn 27b bf16": ("gdn", (*_GDN_27B, "bfloat16", 2 * 16 * 128 + 48 * 128, True, False)),
    "gdn 27b fp32": ("gdn", (*_GDN_27B, "float32", 2 * 16 * 128 + 48 * 128, True, False)),
    "gdn tiny-k128 fp32": ("gdn", (2, 4, 128, 128, "float32", 2 * 2 * 128 + 4 * 128, True, False)),
    "gdn bench256 bf16": ("gdn", (4, 8, 128, 128, "bfloat16", 2 * 4 * 128 + 8 * 128, True, False)),
    "gdn bench256 bf16 transformers": ("gdn", (4, 8, 128, 128, "bfloat16", 0, False, True)),
    "dsa glm52 bf16": ("dsa", (32, 128, 2048, 64, 512, 192, 64, "bfloat16")),
    "dsa glm52 fp32": ("dsa", (32, 128, 2048, 64, 512, 192, 64, "float32")),
    "dsa glm52-h16 bf16": ("dsa", (32, 128, 2048, 16, 512, 192, 64, "bfloat16")),
    "dsa glm52-h16 fp32": ("dsa", (32, 128, 2048, 16, 512, 192, 64, "float32")),
    "dsa tiny fp32": ("dsa", (4, 8, 8, 4, 12, 6, 4, "float32")),
    "kda glm53 bf16 general": ("kda", (4, 128, 128, "bfloat16", None)),
    "kda glm53 bf16 bounded": ("kda", (4, 128, 128, "bfloat16", -5.0)),
    "kda glm53 fp32 general": ("kda", (4, 128, 128, "float32", None)),
    "kda glm53 fp32 bounded": ("kda", (4, 128, 128, "float32", -5.0)),
}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(x.ru_utime + x.ru_stime for x in r)


def _gdn(hk, hv, dk, dv, dtype, ch, with_state, transformers_call, T=192):
    import torch

    from longstraw_mcore.ops import fla_gdn

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    mk = lambda *s, d=dt: torch.randn(*s, generator=g).to(d).requires_grad_()  # noqa: E731
    q, k, v = mk(1, T, hk, dk), mk(1, T, hk, dk), mk(1, T, hv, dv)
    gate = (-torch.rand(1, T, hv, generator=g)).requires_grad_()
    beta = torch.rand(1, T, hv, generator=g).to(dt).requires_grad_()
    if transformers_call:  # transformers' Qwen3.5 / 3.6 layer: no state in, none out, l2norm in the kernel
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, _ = chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()
        return
    h0 = mk(1, hv, dk, dv, d=torch.float32) if with_state else None
    o, final = fla_gdn.chunk_gated_delta_rule(q, k, v, gate, beta, h0)
    (o.float().sum() + final.sum()).backward()
    x, w, state = mk(1, T, ch), mk(ch, 4), mk(1, ch, 3)
    y, s = fla_gdn.causal_conv1d(x, w, state, "silu")
    (y.float().sum() + s.float().sum()).backward()
    y, s = fla_gdn.causal_conv1d(x, w, None, "silu")  # (a branch's first piece: no window in)
    (y.float().sum() + s.float().sum()).backward()


def _dsa(hi, di, topk, h, r, dn, dr, dtype):
    import torch

    import gpu_warmup

    gpu_warmup.dsa_path(hi, di, topk, h, r, dn, dr, getattr(torch, dtype), "cpu")


def _kda(h, dk, dv, dtype, lower_bound, T=192):
    import torch

    from longstraw_mcore.ops import fla_kda

    dt = getattr(torch, dtype)
    g0 = torch.Generator().manual_seed(0)
    mk = lambda *s, d=dt: torch.randn(*s, generator=g0).to(d).requires_grad_()  # noqa: E731
    q, k, v = mk(1, T, h, dk), mk(1, T, h, dk), mk(1, T, h, dv)
    lo = -5.0 if lower_bound is None else lower_bound
    gate = (torch.rand(1, T, h, dk, generator=g0) * lo).requires_grad_()
    beta = torch.rand(1, T, h, generator=g0).to(dt).requires_grad_()
    for h0 in (mk(1, h, dk, dv, d=torch.float32), None):
        o, final = fla_kda.chunk_kda(q, k, v, gate, beta, h0, lower_bound=lower_bound)
        (o.float().sum() + final.sum()).backward()


RUNNERS = {"gdn": _gdn, "dsa": _dsa, "kda": _kda}


def _prepare_fla():
    """After OfflineHopper is entered: fla imported as the device imports it, with two CPU-tensor gaps bridged
    (fla asks a tensor for its CUDA index, None on the CPU; the project's Hopper gate asks the tensor's device)."""
    import fla.utils as fu
    import fla.utils.hardware as hw

    from longstraw_mcore.ops import fla_gdn

    fla_gdn.prepare()
    inner = hw.check_shared_mem

    def check_shared_mem(arch="none", tensor_idx=0):
        return inner(arch, 0 if tensor_idx is None else tensor_idx)

    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("fla") and getattr(m, "check_shared_mem", None) is inner:
            m.check_shared_mem = check_shared_mem
    fla_gdn._hopper_gate_applies = lambda device: fla_gdn._hopper_gate_on(0)
    return {"hopper": bool(getattr(hw, "IS_NVIDIA_HOPPER", False)), "fla": getattr(fu, "__version__", None)}


def worker(names: list[str], mode: str, winners_dir: str | None, out_json: str) -> int:
    from longstraw_mcore.ops import triton_aot

    winners = triton_aot.load_winners(Path(winners_dir)) if winners_dir else {}
    res = {}
    with triton_aot.OfflineHopper(mode, winners, log=lambda s: print(s, flush=True)) as aot:
        seen = _prepare_fla()
        print(f"[aot] worker {os.getpid()}: fla sees a Hopper GPU: {seen['hopper']}", flush=True)
        for name in names:
            kind, args = PATHS[name]
            n0, a0, t0, c0 = len(aot.records), len(aot.autotuned), time.perf_counter(), _cpu_s()
            RUNNERS[kind](*args)
            new = aot.records[n0:]
            res[name] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(_cpu_s() - c0, 1),
                         "compiles": sum(not r.cache_hit for r in new), "hits": sum(r.cache_hit for r in new),
                         "compile_s": round(sum(r.seconds for r in new if not r.cache_hit), 1),
                         "autotuned": aot.autotuned[a0:]}
            print(f"[aot] {name}: {res[name]['compiles']} compiles, {res[name]['hits']} cached, "
                  f"{res[name]['wall_s']:.0f} s", flush=True)
            Path(out_json).write_text(json.dumps(res, indent=1))
    return 0


def _workers(shares, mode, winners, env, out: Path, tag: str) -> tuple[list[int], dict]:
    """Run each share of paths in its own process (a fresh Triton and fla each); their per-path reports."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(s), str(out / f"{tag}{i}.json"),
                               "--mode", mode, *(["--winners", str(winners)] if winners else [])], env=env)
             for i, s in enumerate(shares)]
    rcs, paths = [pr.wait() for pr in procs], {}
    for i in range(len(shares)):
        f = out / f"{tag}{i}.json"
        if f.exists():
            paths.update(json.loads(f.read_text()))
            f.unlink()
    return rcs, paths


def _default_winners() -> Path | None:
    found = sorted((ROOT / "bench_results").glob("*_autotune"))
    return found[-1] if found else None


def main(argv=None) -> int:
    from longstraw_mcore.ops import triton_cache

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?")
    p.add_argument("--mode", choices=("auto", "full", "pinned", "check"), default="auto")
    p.add_argument("--only", default=None, help="regex over the path names (--list prints them)")
    p.add_argument("--winners", type=Path, default=None, help="a folder of the device's *.autotune.json records")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--cache", default=triton_cache.FIXED_CACHE_DIR)
    p.add_argument("--list", action="store_true")
    p.add_argument("--worker", nargs=2, metavar=("NAMES_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.list:
        print("\n".join(PATHS))
        return 0
    if a.winners is not None and not a.winners.is_dir():
        p.error(f"--winners {a.winners}: no such folder")
    winners = a.winners or (_default_winners() if a.mode != "full" else None)
    mode = a.mode if a.mode != "auto" else ("pinned" if winners else "full")
    if mode == "check" and not a.worker:
        p.error("--mode check is the verify step's own (it runs after every build)")
    if a.worker:
        return worker(json.loads(a.worker[0]), mode, str(winners) if winners else None, a.worker[1])
    if not a.out:
        p.error("OUT is required")
    names = [n for n in PATHS if a.only is None or re.search(a.only, n)]
    if not names:
        p.error(f"--only {a.only!r} matches none of: {', '.join(PATHS)}")
    if a.jobs < 1:
        p.error(f"--jobs {a.jobs}: expected >= 1")
    out, cache = Path(a.out), Path(a.cache)
    if cache.exists() and any(f.is_file() for f in cache.iterdir()):
        p.error(f"--cache {cache} holds files, so it is not a Triton cache (whose entries are folders); "
                "it is emptied first, so name an empty or a Triton cache folder")
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), TRITON_STORE_BINARY_ONLY="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    # the costliest paths first, dealt round-robin to the workers (fp32 fla's backward dominates)
    order = sorted(names, key=lambda n: (("fp32" not in n), n.startswith("dsa")))
    shares = [order[i::a.jobs] for i in range(min(a.jobs, len(order)))]
    print(f"[aot] {mode}: {len(names)} paths on {len(shares)} workers into {cache} (winners: {winners})", flush=True)
    t0, c0 = time.perf_counter(), _cpu_s()
    rcs, paths = _workers(shares, mode, winners, env, out, "build")
    wall = round(time.perf_counter() - t0, 1)
    manifest = triton_cache.make_manifest(cache, mode=mode, paths=sorted(paths),
                                          winners=str(winners) if winners else None)
    size = triton_cache.pack(cache, out / "triton-sm90.tar.xz", manifest)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    report = {"mode": mode, "wall_s": wall, "cpu_s": round(_cpu_s() - c0, 1), "workers": len(shares),
              "compiles": sum(v["compiles"] for v in paths.values()), "cache_bytes": manifest["bytes"], **size,
              "kernels": manifest["kernels"], "autotune_records": manifest["autotune_records"],
              "triton": manifest["triton"], "triton_key": manifest["triton_key"], "paths": paths,
              "missing_paths": [n for n in names if n not in paths]}
    # a fresh process takes every path again as the device would (pinned: Triton's own autotuner reading the
    # records): what it still compiles would be compiled on the device
    check_mode = "check" if mode == "pinned" else "full"
    vrcs, vpaths = _workers(shares, check_mode, winners, dict(env, TRITON_CACHE_AUTOTUNING="1"), out, "verify")
    report["verify"] = {"mode": check_mode, "exit": vrcs, "compiles": sum(v["compiles"] for v in vpaths.values()),
                        "hits": sum(v["hits"] for v in vpaths.values()),
                        "compiled": {n: v["compiles"] for n, v in vpaths.items() if v["compiles"]}}
    rcs += vrcs
    (out / "aot.json").write_text(json.dumps(report, indent=1))
    mib = 2 ** 20
    print(f"[aot] {report['compiles']} compiles in {wall / 60:.1f} min ({report['cpu_s'] / 60:.0f} CPU-min); cache "
          f"{manifest['bytes'] / mib:.1f} MiB, archive {size['archive_bytes'] / mib:.1f} MiB: {out / 'triton-sm90.tar.xz'}")
    print(f"[aot] verify ({check_mode}, a fresh process): {report['verify']['compiles']} compiles, "
          f"{report['verify']['hits']} cache hits", flush=True)
    if any(rcs) or report["missing_paths"] or report["verify"]["compiles"]:
        print(f"[aot] FAILED: worker exit codes {rcs}; paths not done: {report['missing_paths']}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
