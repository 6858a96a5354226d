#!/usr/bin/env bash
# N ranks of a longstraw subcommand under mpirun (Open MPI, MPICH): MPI gives each process its rank,
# launch_mpi turns it into torch.distributed's environment and runs the normal entry point. For Slurm
# sites that launch with PMIx, the same module runs under srun:
#   srun --mpi=pmix --ntasks-per-node=8 python -m longstraw_mcore.launch_mpi validate --config ...
# Usage:
#   bash launch/mpirun.sh 2 validate --config configs/qwen3.6-tiny.yaml --hf DIR --rollouts r.jsonl \
#       --out runs/v parallel.tp=2
# Extra mpirun options (host file, binding) go in MPIRUN_ARGS, e.g. MPIRUN_ARGS="--hostfile hosts".
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bash launch/mpirun.sh NPROC SUBCOMMAND [ARGS ...]" >&2; exit 2; }
n=$1; shift
case "$n" in ''|*[!0-9]*|0) echo "error: NPROC '$n' must be a positive integer" >&2; exit 2;; esac
command -v mpirun >/dev/null 2>&1 || { echo "error: mpirun not found (Debian: apt-get install openmpi-bin)" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
py="${PYTHON:-$(bash "$repo/scripts/env.sh")/bin/python}"
cd "$repo"
extra=()
# Open MPI refuses root unless told; containers often run as root
if [ "$(id -u)" = 0 ] && mpirun --version 2>/dev/null | grep -q "Open MPI"; then extra+=(--allow-run-as-root); fi
# shellcheck disable=SC2086
exec mpirun "${extra[@]}" ${MPIRUN_ARGS:-} -np "$n" -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" -x PYTHONPATH="$repo" \
  "$py" -m longstraw_mcore.launch_mpi "$@"
