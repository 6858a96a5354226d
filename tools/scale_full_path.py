#!/usr/bin/env python
"""The mission's scale check on one box, alone and under load: `launch/validate_full_path.sh` on N ranks (GLM-5.2's
78 layers at tiny width, PP=2 x CP=4 x EP=16, DP=4 at 32 ranks by default), once beside each count of busy
processes, every run against `longstraw validate` at one rank on the same inputs (issue 57).

  python tools/scale_full_path.py OUT [--ranks 32] [--busy 0,2] [--tol 1e-4] [--config CFG] [--inputs DIR]
                                      [key=value ...]

Default overrides: the issue's (model.n_routed_experts=32 parallel.pp=2 "parallel.pp_layers=[38,40]" parallel.cp=4
parallel.ep=16); PROMPT_LEN=40 RESPONSE_LEN=4 GROUP_SIZE=3. The first run writes the model and rollouts
(OUT/busy0.inputs), the others and the one-rank reference take them. A run passes when it exits 0, no rank said
"[peers] ... no heartbeat" or was ended by the launcher, and it equals the reference within --tol (loss, grad
norm relative; log-probs absolute; every dumped gradient against the largest of any tensor) with its receipt's
grad norm equal to its own dumped gradients' norm. Prints a table; writes OUT/scale.json. 32 ranks take about
13 minutes alone on 2 cores, longer beside busy processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

ISSUE_LAYOUT = ["model.n_routed_experts=32", "parallel.pp=2", "parallel.pp_layers=[38,40]", "parallel.cp=4",
                "parallel.ep=16"]


def _run(argv: list[str], log: Path, env: dict) -> tuple[int, float]:
    t = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, round(time.monotonic() - t, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--busy", default="0,2", help="comma-separated counts of spinning processes, one run each")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--config", default="configs/glm-5.2-tiny.yaml")
    p.add_argument("--inputs", type=Path, help="an earlier run's OUT/busyK.inputs (hf/ + rollouts.jsonl) to take")
    p.add_argument("overrides", nargs="*", help=f"default: {' '.join(ISSUE_LAYOUT)}")
    a = p.parse_args(argv)
    busy_counts = [int(x) for x in a.busy.split(",") if x != ""]
    over = a.overrides or ISSUE_LAYOUT
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        p.error(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = dict(os.environ, PYTHON=py, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PROMPT_LEN="40", RESPONSE_LEN="4",
               GROUP_SIZE="3")
    from compare_validate import compare

    inputs, runs = a.inputs, []
    if inputs is not None and not ((inputs / "hf").is_dir() and (inputs / "rollouts.jsonl").is_file()):
        p.error(f"--inputs {inputs} holds no hf/ and rollouts.jsonl (pass an earlier run's OUT/busyK.inputs)")
    for k in busy_counts:
        name = f"busy{k}"
        weights = ["--hf", str(inputs / "hf"), "--rollouts", str(inputs / "rollouts.jsonl")] if inputs else []
        print(f"[scale] {a.ranks} ranks beside {k} busy process(es) ...", flush=True)
        spin = [subprocess.Popen([py, "-c", "while True: pass"]) for _ in range(k)]
        try:
            rc, took = _run(["bash", "launch/validate_full_path.sh", str(a.ranks), a.config, str(out / name), *weights,
                             *over], out / f"{name}.log", dict(env, LOG_DIR=str(out / f"{name}.logs")))
        finally:
            for s in spin:
                s.kill()
                s.wait()
        text = (out / f"{name}.log").read_text(errors="replace")
        runs.append({"busy": k, "exit": rc, "seconds": took, "peers_lines": text.count("[peers]"),
                     "launcher_lines": text.count("[launch]")})
        print(f"[scale] {name}: exit {rc} in {took:.0f} s", flush=True)
        inputs = inputs or out / f"{name}.inputs"
    print("[scale] the one-rank reference ...", flush=True)
    rc, took = _run([py, "-m", "longstraw_mcore", "validate", "--config", a.config, "--hf", str(inputs / "hf"),
                     "--rollouts", str(inputs / "rollouts.jsonl"), "--out", str(out / "one_rank"), "--mode", "exact",
                     "--dump-grads", *[o for o in over if not o.startswith("parallel.")]], out / "one_rank.log", env)
    ref = {"exit": rc, "seconds": took}
    ok = rc == 0
    for r in runs:
        r["ok"] = r["exit"] == 0 and r["peers_lines"] == 0 and r["launcher_lines"] == 0 and rc == 0
        if r["exit"] == 0 and rc == 0:
            d = compare(out / f"busy{r['busy']}", out / "one_rank")
            r["diff"] = {k: d[k] for k in ("loss", "logprob_abs", "grad_norm", "grad_worst_normwise",
                                           "grad_norm_vs_dump_a", "grad_norm_vs_dump_b")}
            r["seconds_in_receipt"] = json.loads((out / f"busy{r['busy']}" / "receipt.json").read_text())["seconds"]
            r["ok"] = r["ok"] and all(v <= a.tol for v in r["diff"].values())
        ok = ok and r["ok"]
    print(f"\n{'busy':>4} {'exit':>4} {'wall s':>7} {'loss':>8} {'log-prob':>9} {'grad norm':>9} {'grads':>8} "
          f"{'norm/dump':>9}  ok")
    for r in runs:
        d = r.get("diff", {})
        f = lambda k: f"{d[k]:.1e}" if k in d else "-"  # noqa: E731
        print(f"{r['busy']:>4} {r['exit']:>4} {r['seconds']:>7.0f} {f('loss'):>8} {f('logprob_abs'):>9} "
              f"{f('grad_norm'):>9} {f('grad_worst_normwise'):>8} {f('grad_norm_vs_dump_a'):>9}  {r['ok']}")
    print(f"one rank: exit {ref['exit']} in {ref['seconds']:.0f} s")
    (out / "scale.json").write_text(json.dumps({"ranks": a.ranks, "config": a.config, "overrides": over,
                                                "tol": a.tol, "runs": runs, "one_rank": ref, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
