#!/usr/bin/env python
"""transformers' own time for the groups of a rollouts file, on a Hugging Face directory: the peer a
`longstraw validate` receipt's seconds are compared with, as a new user would compare them.

  python tools/time_transformers.py --hf DIR --rollouts r.jsonl [--paths cache,full] [--out t.json]
  python -m longstraw_mcore validate --hf DIR --rollouts r.jsonl --out v --mode detached   (receipt: seconds)

Paths (longstraw_mcore/bench/vs_transformers.py, the same GRPO terms as ours, back-propagated):
  cache   the prompt under no_grad once, each branch with autograd on a copy of its cache (what detached
          mode computes)
  full    each branch a full prompt + response sequence with autograd (what exact mode computes)
`Qwen3_5ForCausalLM.from_pretrained` in the directory's dtype, SDPA attention, its torch Gated DeltaNet
rule on the CPU (bench/hf_kernels.py; fla on CUDA where installed). Each path runs every group twice and
the second run is timed (the receipt's seconds are a process's first group; --cold times the first run
instead). Prints seconds per path and phase and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True)
    p.add_argument("--rollouts", required=True)
    p.add_argument("--paths", default="cache")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cold", action="store_true", help="time each path's first run")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    paths = a.paths.split(",")
    if not set(paths) <= {"cache", "full"}:
        raise SystemExit(f"--paths {a.paths}: cache and/or full")
    import torch

    from longstraw_mcore.bench import vs_transformers as vt
    from longstraw_mcore.bench.hf_kernels import fast_path, gdn_path, qwen3_5_modeling
    from longstraw_mcore.config import GRPOConfig
    from longstraw_mcore.data.rollouts import load_rollouts
    from longstraw_mcore.families import read_hf_config
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn

    dev = torch.device(a.device)
    M = qwen3_5_modeling(fla=fast_path(dev.type))
    m, _ = read_hf_config(a.hf)
    hf = M.Qwen3_5ForCausalLM.from_pretrained(a.hf, dtype=m.torch_dtype, attn_implementation="sdpa").to(dev).eval()
    groups = load_rollouts(a.rollouts, m.vocab_size)
    gcfg = GRPOConfig()
    out = {"hf": a.hf, "rollouts": a.rollouts, "device": str(dev), "gdn_rule": gdn_path(M), "dtype": m.dtype,
           "threads": torch.get_num_threads(), "timed": "first run" if a.cold else "second run", "paths": {}}
    for path in paths:
        total, phases = 0.0, {}
        for g in groups:
            fn = group_loss_fn(g, gcfg, advantages(g.rewards, gcfg))
            for _ in range(1 if a.cold else 2):  # the last run is timed
                hf.zero_grad(set_to_none=True)
                vt._sync(dev)
                t0 = time.perf_counter()
                if path == "cache":
                    pre = vt.hf_cache(hf, g.prompt, g.responses, fn)
                else:
                    vt.hf_full(hf, g.prompt, g.responses, fn)
                    pre = 0.0
                vt._sync(dev)
                secs = time.perf_counter() - t0
            total += secs
            phases["prompt"] = phases.get("prompt", 0.0) + pre
            phases["branches"] = phases.get("branches", 0.0) + secs - pre
        out["paths"][path] = {"seconds": total, "phases": phases}
        print(f"transformers {path}: {total:.2f} s (" + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + ")",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
