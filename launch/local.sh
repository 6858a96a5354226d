#!/usr/bin/env bash
# One node: N ranks of a longstraw subcommand (gloo on CPU, NCCL on CUDA: the config's `device`), started
# by longstraw_mcore/launcher.py: signals forwarded to every rank, the ranks' exit status passed out (2 bad
# input, 3 diverged, 75 stopped on a signal with a checkpoint), lines prefixed with the global rank,
# per-rank logs with --log-dir (LOG_DIR). The environment comes from scripts/env.sh (created once, reused).
#   bash launch/local.sh 4 validate --config configs/qwen3.6-tiny.yaml --hf DIR --rollouts r.jsonl \
#       --out runs/v parallel.tp=2 parallel.pp=2
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bash launch/local.sh NPROC SUBCOMMAND [ARGS ...]" >&2; exit 2; }
n=$1; shift
case "$n" in ''|*[!0-9]*|0) echo "error: NPROC '$n' must be a positive integer" >&2; exit 2;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
py="${PYTHON:-$(bash "$repo/scripts/env.sh")/bin/python}"
cd "$repo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
logs=()
[ -n "${LOG_DIR:-}" ] && logs=(--log-dir "$LOG_DIR")
exec env PYTHONPATH="$repo" "$py" -m longstraw_mcore.launcher --nproc "$n" "${logs[@]}" -- "$@"
