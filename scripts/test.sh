#!/usr/bin/env bash
# Set up the environment (once; reused after) and run the whole test suite on CPU.
#   bash scripts/test.sh [pytest args]
# Two pytest workers (pytest-xdist, LONGSTRAW_TEST_WORKERS to change; 0: none), a test file per worker at a
# time: most tests keep one core busy at most (a rank waiting on its peer, a process starting), so two side
# by side use a 2-core machine's time that one left idle.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv=$(bash "$repo/scripts/env.sh" --test)
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers="${LONGSTRAW_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then exec "$venv/bin/python" -m pytest "$@"; fi
exec "$venv/bin/python" -m pytest -n "$workers" --dist loadfile "$@"
