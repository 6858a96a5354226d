#!/usr/bin/env bash
# Set up the environment (once; reused after) and run the main job on the CPU demo configuration:
# on-policy GRPO with branch replay (`longstraw train --online`) on the key-recall task
# (configs/demo-key-recall.yaml), the tiny Qwen3.6-family hybrid from random init, 2 gloo ranks (data
# parallel; started by longstraw_mcore/launcher.py, as launch/local.sh starts them). Every step samples G
# responses per prompt from the current weights against the captured prompt state, scores them and
# trains; held-out greedy reward every 10 steps.
# Writes runs/demo/metrics.jsonl, runs/demo/reward.png and checkpoints; prints the held-out reward
# against chance (what a policy that ignores the prompt scores). About 7 minutes on 2 cores.
# --config configs/demo-tool-lookup.yaml: the multi-turn demo (a loss-masked tool output between two turns).
# --ppo: PPO with a critic instead of GRPO (grpo.objective=ppo, whitened advantages, the critic starting
# from the policy's weights with a new value head: docs/ppo.md).
#   bash scripts/demo.sh [--config FILE] [--mode exact|detached] [--steps N] [--out DIR] [--ppo] [key=value ...]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode=exact steps=60 run="$repo/runs/demo" config=configs/demo-key-recall.yaml objective=grpo
while [ $# -gt 0 ]; do
  case "$1" in
    --ppo) objective=ppo; shift;;
    --mode) mode=$2; shift 2;;
    --config) config=$2; shift 2;;
    --steps) steps=$2; shift 2;;
    --out) run=$2; shift 2;;
    *) break;;
  esac
done
case "$mode" in exact|detached) ;; *) echo "error: --mode '$mode': must be exact or detached" >&2; exit 2;; esac
case "$steps" in ''|*[!0-9]*|0) echo "error: --steps '$steps' must be a positive integer" >&2; exit 2;; esac
venv=$(bash "$repo/scripts/env.sh")
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# only a previous demo's folder (or an empty one) is replaced
if [ "$run" != "$repo/runs/demo" ] && [ -e "$run" ] && [ -n "$(ls -A "$run" 2>/dev/null)" ] && [ ! -f "$run/metrics.jsonl" ]; then
  echo "error: --out '$run' exists and is not a previous demo run (no metrics.jsonl); choose another folder" >&2; exit 2
fi
rm -rf "$run" && mkdir -p "$run"
ppo=()
[ "$objective" = ppo ] && ppo=(grpo.objective=ppo ppo.whiten_advantages=true --critic policy)
t0=$(date +%s)
"$venv/bin/python" -m longstraw_mcore.launcher --nproc 2 --log-dir "$run/logs" \
  -- train --config "$config" --online --steps "$steps" \
  --save "$run/ckpt" --metrics-out "$run/metrics.jsonl" replay.mode="$mode" train.save_every="$steps" "$@" \
  "${ppo[@]}"
read -r chance lengths task < <("$venv/bin/python" -c 'import sys; from longstraw_mcore.config import load_config; from longstraw_mcore.rollout.online import make_task
c = load_config(sys.argv[1], sys.argv[2:]); print(make_task(c).chance, f"{c.task.min_len}-{c.task.max_len}", c.task.name.replace("_", "-"))' "$config" "$@")
"$venv/bin/python" - "$run/metrics.jsonl" "$mode" "$(( $(date +%s) - t0 ))" "$chance" "$lengths" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
held = [(m["step"], m["heldout_reward"]) for m in rows if "heldout_reward" in m]
chance = float(sys.argv[4])
first, last = held[0][1], held[-1][1]
print(f"[demo] {sys.argv[2]} mode, {rows[-1]['step']} steps in {sys.argv[3]} s: held-out reward (prompts of "
      f"{sys.argv[5]} tokens) {first:.3f} at step 0 -> "
      f"{last:.3f} at step {held[-1][0]}; chance (a policy ignoring the context) {chance:.3f}: "
      f"{last / chance:.1f}x chance ({'>=' if last >= 5 * chance else 'below'} 5x)")
PY
"$venv/bin/python" tools/plot_rewards.py "$run/metrics.jsonl" --label "$mode" --out "$run/reward.png" --chance "$chance" \
  --title "$task, held-out prompts of $lengths tokens: on-policy ${objective^^} with branch replay"
