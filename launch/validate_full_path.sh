#!/usr/bin/env bash
# The full execution path in one command: `longstraw validate` (capture, replay, exact-mode prompt
# backward, gradient reduction, gradients dumped under Hugging Face names) on N ranks from a config, with
# a receipt: loss, log-probs, every layer touched (and every expert), per-layer state bytes, per-rank
# peak memory beside the planner's prediction, seconds per phase, software versions.
#
#   bash launch/validate_full_path.sh N CONFIG OUT_DIR [--hf DIR | --load DIR] [--rollouts FILE] [key=value ...]
#
# N ranks on this node (launch/local.sh), or inside a Slurm allocation (SLURM_JOB_ID set) the allocation's
# ranks through launch/slurm.sbatch's per-node launcher. Without --hf/--load a seeded random model of the
# config is written (tiny configs); without --rollouts synthetic groups are written (PROMPT_LEN,
# RESPONSE_LEN, GROUP_SIZE, GROUPS_N; defaults 48, 8, 4, one group per data-parallel rank).
#   examples:
#     bash launch/validate_full_path.sh 4 configs/qwen3.6-tiny.yaml runs/v-pp2cp2 parallel.pp=2 parallel.cp=2
#     sbatch --nodes 4 --gpus-per-node 8 launch/validate_full_path.sh 32 configs/glm-5.2.yaml \
#         runs/glm-2m --hf /ckpt/GLM-5.2 --rollouts rollouts-2m.jsonl parallel.cp=4 parallel.ep=32
# (submit the script itself: `sbatch --wrap "bash ..."` drops the #SBATCH lines below, leaving one task of
# one CPU per node)
#SBATCH --job-name=longstraw-validate
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: bash launch/validate_full_path.sh N CONFIG OUT_DIR [--hf DIR|--load DIR] [--rollouts F] [key=value ...]" >&2; exit 2; }
n=$1 cfg=$2 out=$3; shift 3
case "$n" in ''|*[!0-9]*|0) echo "error: N '$n' must be a positive integer" >&2; exit 2;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
# (submitted with sbatch the script runs from Slurm's spool: the checkout is where it was submitted from)
[ -d "$repo/longstraw_mcore" ] || repo=$(cd "${SLURM_SUBMIT_DIR:?not in a checkout and not under Slurm}" && pwd)
py="${PYTHON:-$(bash "$repo/scripts/env.sh")/bin/python}"
cd "$repo"
weights=() rollouts="" overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hf|--load) weights=("$1" "$2"); shift 2;;
    --rollouts) rollouts=$2; shift 2;;
    *) overrides+=("$1"); shift;;
  esac
done
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
  echo "error: $out exists and is not empty; refusing to overwrite" >&2; exit 2
fi
work="$out.inputs"
mkdir -p "$work"
# the layout against the world size, before anything is generated or started
PYTHONPATH="$repo" "$py" -m longstraw_mcore check --cmd validate --config "$cfg" --world-size "$n" "${overrides[@]}"
if [ ${#weights[@]} -eq 0 ]; then
  PYTHONPATH="$repo" "$py" tools/make_hf_model.py "$work/hf" --config "$cfg" "${overrides[@]}" >&2
  weights=(--hf "$work/hf")
fi
if [ -z "$rollouts" ]; then
  groups=${GROUPS_N:-$(PYTHONPATH="$repo" "$py" -c "
import sys; from longstraw_mcore.config import load_config
c = load_config(sys.argv[1], sys.argv[3:]); print(c.parallel.dp_for(int(sys.argv[2])))" "$cfg" "$n" "${overrides[@]}")}
  vocab=$(PYTHONPATH="$repo" "$py" -c "
import sys; from longstraw_mcore.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).model.vocab_size)" "$cfg" "${overrides[@]}")
  rollouts="$work/rollouts.jsonl"
  PYTHONPATH="$repo" "$py" tools/make_rollouts.py "$rollouts" --vocab "$vocab" --groups "$groups" \
    --prompt-len "${PROMPT_LEN:-48}" --group-size "${GROUP_SIZE:-4}" --response-len "${RESPONSE_LEN:-8}" >&2
fi
args=(validate --config "$cfg" "${weights[@]}" --rollouts "$rollouts" --out "$out" --mode exact --dump-grads
      "${overrides[@]}")
if [ -n "${SLURM_JOB_ID:-}" ]; then
  PYTHON="$py" bash "$repo/launch/slurm.sbatch" "${args[@]}"
else
  PYTHON="$py" bash "$repo/launch/local.sh" "$n" "${args[@]}"
fi
echo "[validate_full_path] receipt: $out/receipt.json" >&2
