#!/usr/bin/env bash
# Set up the environment (once; reused after) and run the main job on the CPU demo configuration:
# the tiny Qwen3.6-family hybrid model, tensor parallel over 2 gloo ranks under torchrun.
#   bash scripts/demo.sh [extra key=value overrides]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv=$(bash "$repo/scripts/env.sh")
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m longstraw_mcore smoke --config configs/qwen3.6-tiny.yaml --steps 3 parallel.tp=2 device=cpu "$@"
