"""Many ranks start on a loaded machine (issue 57): 16 ranks of `longstraw smoke` through the launcher (what
launch/local.sh runs), TP=2 x PP=2 x DP=4 on the tiny hybrid, beside two processes spinning on the CPU, on
the 2-core CI machine: 18 busy processes, every rank importing torch and Megatron-Core against one rendezvous
store. On landed main before this issue the optional heartbeat's 5-second connection to the store ended such
start-ups (seen at 32 ranks, with and without other jobs); now every optional helper waits as long as the
rendezvous itself would (parallel/peers.py, launch_local.reserve_port for the port). The run must finish, every
rank's heartbeat must have connected (no "[peers]" line), and the step must be recorded: the model end to end
in bf16 from the command line (random init: a loss near ln 512). The 32-rank GLM-5.2 full path under load is a
scale run (launch/validate_full_path.sh; its figures in docs/status.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from launch import longstraw


def test_sixteen_ranks_start_beside_two_busy_processes(tmp_path):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        r = longstraw(16, "smoke", "--config", "configs/qwen3.6-tiny.yaml", "--steps", "1", "--batch", "1",
                      "--seq-len", "33", "--metrics-out", str(tmp_path / "metrics.jsonl"), "model.num_layers=2",
                      "model.dtype=bfloat16", "parallel.tp=2", "parallel.pp=2", timeout=840)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[peers]" not in r.stderr and "[launch]" not in r.stderr, r.stderr[-3000:]
    assert "layout tp=2 pp=2 cp=1 dp=4 on 16 cpu rank(s)" in r.stdout and "dtype bfloat16" in r.stdout, r.stdout[-2000:]
    [rec] = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec["step"] == 1 and math.isfinite(rec["loss"]) and abs(rec["loss"] - math.log(512)) < 0.5, rec
