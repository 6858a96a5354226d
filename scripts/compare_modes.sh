#!/usr/bin/env bash
# The value of the exact gradient as a figure: the CPU demo (scripts/demo.sh, key recall, on-policy GRPO)
# in detached mode (LongStraw's truncated gradient: the prompt state held constant) and in exact mode
# (full-sequence GRPO), with the same seeds (model init, sampling, prompts). Prints a table of held-out
# reward per seed and mode, writes runs/compare/table.md, runs/compare/results.json and
# runs/compare/reward.png (every run's held-out curve).
#   bash scripts/compare_modes.sh [--seeds "1 2 3"] [--steps N] [extra key=value overrides]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seeds="1 2 3" steps=30
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) seeds=$2; shift 2;;
    --steps) steps=$2; shift 2;;
    *) break;;
  esac
done
venv=$(bash "$repo/scripts/env.sh")
out="$repo/runs/compare"
rm -rf "$out" && mkdir -p "$out"
files=() labels=()
for seed in $seeds; do
  for mode in detached exact; do
    echo "[compare] seed $seed, $mode mode" >&2
    bash "$repo/scripts/demo.sh" --mode "$mode" --steps "$steps" --out "$out/$mode-seed$seed" \
      seed="$seed" rollout.seed="$seed" task.seed="$seed" "$@" 2>&1 | grep '^\[demo\]' >&2
    files+=("$out/$mode-seed$seed/metrics.jsonl") labels+=("$mode seed $seed")
  done
done
cd "$repo"
export PYTHONPATH="$repo"
"$venv/bin/python" - "$out" $seeds <<'PY'
import json, os, sys
from longstraw_mcore.config import load_config
from longstraw_mcore.rollout.online import make_task
out, seeds = sys.argv[1], sys.argv[2:]
chance = make_task(load_config("configs/demo-key-recall.yaml")).chance
res, lines = {}, []
steps = None
for mode in ("detached", "exact"):
    for s in seeds:
        rows = [json.loads(x) for x in open(os.path.join(out, f"{mode}-seed{s}", "metrics.jsonl")) if x.strip()]
        held = {m["step"]: m["heldout_reward"] for m in rows if "heldout_reward" in m}
        res.setdefault(mode, {})[s] = held
        steps = sorted(held)
head = "| mode | seed | " + " | ".join(f"step {k}" for k in steps) + " |"
lines = [head, "|" + "---|" * (len(steps) + 2)]
for mode in ("detached", "exact"):
    for s in seeds:
        lines.append(f"| {mode} | {s} | " + " | ".join(f"{res[mode][s][k]:.3f}" for k in steps) + " |")
    mean = [sum(res[mode][s][k] for s in seeds) / len(seeds) for k in steps]
    lines.append(f"| **{mode} mean** | | " + " | ".join(f"**{x:.3f}**" for x in mean) + " |")
table = "\n".join(lines) + f"\n\nchance (a policy ignoring the prompt): {chance:.3f}; 5x chance: {5 * chance:.3f}\n"
print(table)
open(os.path.join(out, "table.md"), "w").write(table)
json.dump({"chance": chance, "heldout": res}, open(os.path.join(out, "results.json"), "w"), indent=1)
PY
args=()
for i in "${!files[@]}"; do args+=("${files[$i]}" --label "${labels[$i]}"); done
chance=$("$venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["chance"])' "$out/results.json")
"$venv/bin/python" tools/plot_rewards.py "${args[@]}" --out "$out/reward.png" --chance "$chance" \
  --title "key recall: detached vs exact gradient (same seeds)"
