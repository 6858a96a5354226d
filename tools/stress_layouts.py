#!/usr/bin/env python
"""Interleaved pipeline layouts under load, many times over: `longstraw validate` through the launcher, beside
busy processes, every run checked against one rank and every failing run's output kept (issue 57).

  python tools/stress_layouts.py OUT --runs 50 [--busy 2] [--layouts NAME,...] [--timeout 900]

The layouts (4 ranks each, float64, exact mode; `--list` prints them) cycle: Qwen3.6's hybrid at PP=2 x VPP=2
x TP=2 (the layout seen to abort once in 11 loaded runs) and PP=4 x VPP=2, GLM-5.2 at PP=2 x VPP=2 x EP=2 and
PP=4 x VPP=2, GLM-5.3-Flash at PP=2 x VPP=2 x DP=2. Each model's inputs (tools/make_hf_model.py,
tools/make_rollouts.py) and its one-rank receipt are made once. A run passes when the launcher exits 0 and
its receipt equals the one-rank receipt (loss and grad norm relative, log-probs absolute, <= --tol). `--busy K`
keeps K processes spinning on the CPU for the whole loop (the load under which the abort was seen).

A failing run's directory is kept under OUT/runs/ (the launcher's stdout and stderr, every rank's log, the
receipt if any); a passing one's is removed. OUT/summary.json: one record per run (layout, exit status, the
failing rank the launcher named, seconds, differences); a line per run on the console with the ETA.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

GLM8 = ["model.num_layers=8", "model.index_topk_freq=2", "model.index_skip_topk_offset=2",
        "model.first_k_dense_replace=1"]
MODELS = {
    "qwen": ("configs/qwen3.6-tiny.yaml", []),
    "glm52": ("configs/glm-5.2-tiny.yaml", GLM8),
    "glm52_16": ("configs/glm-5.2-tiny.yaml", ["model.num_layers=16"] + GLM8[1:]),
    "glm53": ("configs/glm5.3-flash-tiny.yaml", []),
}
"""name: (config, model overrides); every model in float64."""
LAYOUTS = {
    "qwen-pp2-vpp2-tp2": ("qwen", 4, ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=2"]),
    "qwen-pp4-vpp2": ("qwen", 4, ["parallel.pp=4", "parallel.vpp=2"]),
    "glm52-pp2-vpp2-ep2": ("glm52", 4, ["parallel.pp=2", "parallel.vpp=2", "parallel.ep=2",
                                        "parallel.pp_layers=[1,2,2,3]"]),
    "glm52-pp4-vpp2": ("glm52_16", 4, ["parallel.pp=4", "parallel.vpp=2", "parallel.pp_layers=[1,2,2,2,2,2,2,3]"]),
    "glm53-pp2-vpp2-dp2": ("glm53", 4, ["parallel.pp=2", "parallel.vpp=2"]),
}
"""name: (model, ranks, layout overrides)."""


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _tool(*argv) -> None:
    subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)


def prepare(work: Path, name: str) -> dict:
    """The model's HF directory, rollouts and one-rank receipt (made once under work/name)."""
    cfg, over = MODELS[name]
    over = over + ["model.dtype=float64"]
    d = work / name
    if not (d / "ref" / "receipt.json").is_file():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        _tool("tools/make_hf_model.py", str(d / "hf"), "--config", cfg, *over)
        vocab = json.loads((d / "hf" / "config.json").read_text())
        vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
        _tool("tools/make_rollouts.py", str(d / "rollouts.jsonl"), "--vocab", str(vocab), "--groups", "2",
              "--prompt-len", "24", "--group-size", "3", "--response-len", "5")
        r = _validate(1, cfg, d, d / "ref", over, d / "ref.log", timeout=900)
        if r["rc"] != 0:
            raise SystemExit(f"{name}: the one-rank reference failed (exit {r['rc']}); see {d / 'ref.log'}")
    return {"cfg": cfg, "over": over, "dir": d}


def _validate(n: int, cfg: str, d: Path, out: Path, over: list, log: Path, timeout: float,
              log_dir: Path | None = None) -> dict:
    argv = [sys.executable, "-m", "longstraw_mcore.launcher", "--nproc", str(n),
            *(["--log-dir", str(log_dir)] if log_dir else []), "--",
            "validate", "--config", cfg, "--hf", str(d / "hf"), "--rollouts", str(d / "rollouts.jsonl"),
            "--out", str(out), "--mode", "exact", *over]
    t = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # the launcher ends its ranks on SIGTERM; they die with it anyway
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            rc = "timeout"
    return {"rc": rc, "seconds": round(time.monotonic() - t, 1)}


def _failing_rank(log: Path) -> int | None:
    m = re.search(r"\[launch\] rank (\d+) (?:exited with status|was killed by)", log.read_text(errors="replace"))
    return int(m.group(1)) if m else None


class Busy:
    """K processes spinning on the CPU until closed."""

    def __init__(self, k: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--busy", type=int, default=2, help="processes spinning beside the runs")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names (--list)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as hung")
    p.add_argument("--tol", type=float, default=1e-9)
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    if a.list:
        for name, (model, n, over) in LAYOUTS.items():
            print(f"{name}: {MODELS[model][0]} {' '.join(MODELS[model][1])} on {n} ranks: {' '.join(over)}")
        return 0
    names = [x for x in a.layouts.split(",") if x]
    bad = [x for x in names if x not in LAYOUTS]
    if bad or not names or a.out is None or a.runs < 1:
        p.error(f"give OUT, --runs >= 1 and layouts among {sorted(LAYOUTS)}" + (f" (unknown: {bad})" if bad else ""))
    out = Path(a.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    from compare_validate import compare

    print(f"[stress] preparing {sorted({LAYOUTS[x][0] for x in names})}: inputs and one-rank references", flush=True)
    models = {m: prepare(out / "inputs", m) for m in sorted({LAYOUTS[x][0] for x in names})}
    busy = Busy(a.busy)
    records, t0 = [], time.monotonic()
    try:
        for i in range(a.runs):
            name = names[i % len(names)]
            model, n, over = LAYOUTS[name]
            m = models[model]
            run = out / "runs" / f"{i:03d}_{name}"
            shutil.rmtree(run, ignore_errors=True)
            run.mkdir()
            r = _validate(n, m["cfg"], m["dir"], run / "out", m["over"] + over, run / "launcher.log", a.timeout,
                          log_dir=run / "logs")
            rec = {"run": i, "layout": name, **r}
            if r["rc"] == 0:
                try:
                    diff = compare(run / "out", m["dir"] / "ref")
                    rec["diff"] = {k: diff[k] for k in ("loss", "logprob_abs", "grad_norm")}
                    rec["ok"] = all(v <= a.tol for v in rec["diff"].values())
                except (SystemExit, OSError, ValueError, KeyError) as e:  # (a receipt unlike the reference's)
                    rec["ok"], rec["compare_error"] = False, f"{type(e).__name__}: {e}"
            else:
                rec["ok"], rec["failing_rank"] = False, _failing_rank(run / "launcher.log")
            records.append(rec)
            if rec["ok"]:
                shutil.rmtree(run)
            done = i + 1
            eta = (time.monotonic() - t0) / done * (a.runs - done)
            failed = sum(not x["ok"] for x in records)
            if rec["ok"]:
                what = (f"ok in {r['seconds']:.0f} s (loss {rec['diff']['loss']:.1e}, log-probs "
                        f"{rec['diff']['logprob_abs']:.1e})")
            else:
                what = (f"FAILED: exit {r['rc']}" + (f", rank {rec['failing_rank']}" if rec.get("failing_rank")
                                                     is not None else "")
                        + (f", {rec['compare_error'] if 'compare_error' in rec else 'differs: ' + str(rec.get('diff'))}"
                           if r["rc"] == 0 else "") + f"; kept in {run}")
            print(f"[stress] {done}/{a.runs} {name}: {what}; {failed} failed so far; ETA {eta / 60:.0f} min",
                  flush=True)
            (out / "summary.json").write_text(json.dumps(
                {"runs": len(records), "failed": failed, "busy": a.busy, "tol": a.tol, "layouts": names,
                 "seconds": round(time.monotonic() - t0), "records": records}, indent=1))
    finally:
        busy.close()
    failed = sum(not x["ok"] for x in records)
    print(f"[stress] {len(records)} runs, {failed} failed, {round(time.monotonic() - t0)} s; {out / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
