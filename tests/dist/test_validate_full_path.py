"""launch/validate_full_path.sh: one command from a config to a receipt, here the tiny hybrid config on
4 CPU ranks at TP=2 x CP=2 and PP=2 x CP=2 (random seeded weights and synthetic rollouts written by the
script): every layer touched (by the ranks of its stage), the planner's per-rank bytes beside each
rank's measured peak, seconds per phase, software versions; and a non-empty output directory refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(out, *extra):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PROMPT_LEN="40", RESPONSE_LEN="6",
               GROUP_SIZE="3")
    return subprocess.run(["bash", "launch/validate_full_path.sh", "4", "configs/qwen3.6-tiny.yaml", str(out),
                           "device=cpu", "replay.chunk_len=16",
                           # 4 Gated DeltaNet key heads: they split over tp x cp = 4 ranks
                           "model.linear_num_key_heads=4", "model.linear_num_value_heads=8", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_validate_full_path_on_4_cpu_ranks(tmp_path):
    hf = []  # the second run takes the model the first one wrote (--hf), the script's other input path
    for name, layout, stage_of in (("tp2cp2", ("parallel.tp=2", "parallel.cp=2"), lambda i: 0),
                                   ("pp2cp2", ("parallel.pp=2", "parallel.cp=2"), lambda i: i // 4)):
        out = tmp_path / name
        r = _run(out, *layout, *hf)
        hf = ["--hf", str(tmp_path / "tp2cp2.inputs" / "hf")]
        assert r.returncode == 0, r.stderr[-3000:]
        rec = json.loads((out / "receipt.json").read_text())
        assert rec["layers_touched"] == rec["num_layers"] == 8
        for e in rec["layers"]:
            stage = stage_of(e["layer"])
            ranks = [k for k in range(4) if (k // 2 if "pp" in name else 0) == stage]  # pipeline outermost
            assert e["ranks_touched"] == ranks, (name, e)
        mem = rec["memory"]
        assert len(mem["measured_peak_above_baseline_per_rank"]) == 4 and mem["planned_total_per_rank"] > 0
        assert {"weights", "gradients", "prompt_state", "prompt_state_grad", "activations"} <= \
            set(mem["planned_per_rank_bytes"])
        assert rec["software"]["megatron-core"] and rec["software"]["torch"]
        assert {"capture", "replay"} <= set(rec["seconds"])
        print(f"{name}: planned {mem['planned_total_per_rank'] / 2**20:.1f} MiB per rank, measured "
              f"{[round(b / 2**20, 1) for b in mem['measured_peak_above_baseline_per_rank']]} MiB above the "
              f"baseline, seconds {rec['seconds']}")
    again = _run(tmp_path / "tp2cp2", "parallel.tp=2", "parallel.cp=2")
    assert again.returncode == 2 and "exists and is not empty; refusing to overwrite" in again.stderr
