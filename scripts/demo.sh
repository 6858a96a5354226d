#!/usr/bin/env bash
# Set up the environment (once; reused after) and run the main job on the CPU demo configuration:
# `longstraw train` (GRPO with branch replay, exact mode) on the tiny Qwen3.6-family hybrid model,
# tensor parallel over 2 gloo ranks under torchrun, with a small generated rollouts file.
# Outputs (rollouts, metrics, checkpoints) go to runs/demo/.
#   bash scripts/demo.sh [extra key=value overrides]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv=$(bash "$repo/scripts/env.sh")
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
run="$repo/runs/demo"
rm -rf "$run" && mkdir -p "$run"
"$venv/bin/python" tools/make_rollouts.py "$run/rollouts.jsonl" --vocab 512 --groups 8 --prompt-len 384 \
  --group-size 4 --response-len 32 --equal-reward-every 4
exec "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m longstraw_mcore train --config configs/qwen3.6-tiny.yaml --rollouts "$run/rollouts.jsonl" --steps 6 \
  --save "$run/ckpt" --metrics-out "$run/metrics.jsonl" \
  parallel.tp=2 device=cpu replay.mode=exact replay.chunk_len=128 train.lr=1e-3 train.save_every=3 "$@"
