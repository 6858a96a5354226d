#!/usr/bin/env bash
# Set up the environment (once; reused after) and run the whole test suite on CPU.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv=$(bash "$repo/scripts/env.sh" --test)
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$venv/bin/python" -m pytest "$@"
