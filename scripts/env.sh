#!/usr/bin/env bash
# Create (once) and print the path of the project's Python 3.12 virtual environment.
#
# The venv lives outside the checkout, keyed by a hash of pyproject.toml's dependency lists + requirements/constraints.txt,
# so clean clones and CI reuse it while a changed pin forces a fresh one. It holds the dependencies
# only; the project itself runs from the checkout (scripts put it on PYTHONPATH), so two checkouts
# can share one venv. Override the location with LONGSTRAW_VENV_ROOT.
#   usage: scripts/env.sh [--test]      (--test adds the `test` extra: pytest, transformers, fla-core)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"
root="${LONGSTRAW_VENV_ROOT:-$HOME/.cache/longstraw-mcore}"
# Hash only what decides the environment: the dependency lists and the pins (not pytest settings).
hash=$( { { python3 - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(p["requires-python"], sorted(p["dependencies"]), sorted(p["optional-dependencies"]["test"]))
PY
} 2>/dev/null || cat "$repo/pyproject.toml"  # no tomllib (python3 < 3.11): hash the whole file
cat "$repo/requirements/constraints.txt"; } | sha256sum | cut -c1-12)
venv="$root/venv-$hash"

find_python() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo python3.12; return
  fi
  if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 pyenv exec python3.12 --version >/dev/null 2>&1; then
    echo "env PYENV_VERSION=3.12.1 pyenv exec python3.12"; return
  fi
  echo "error: need a Python 3.12 interpreter (python3.12 on PATH, or pyenv's 3.12.1); megatron-core>=0.17 requires it" >&2
  exit 1
}

stamp() { echo "$venv/.ready-${1}"; }
mkdir -p "$root"
exec 9>"$root/.lock-$hash"
flock 9  # one builder at a time; others wait, then find it ready
if [ ! -f "$(stamp base)" ]; then
  py=$(find_python)
  # Build in place (console-script shebangs hold the venv path); the stamp marks it complete, so a
  # half-built venv from an interrupted run is never used: it is wiped and rebuilt.
  rm -rf "$venv"
  echo "[env] creating $venv (Python 3.12, megatron-core 0.19, torch ~5.5 GB: a few minutes once)" >&2
  $py -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade "pip>=24" >&2
  # Dependencies only (the checkout is put on PYTHONPATH). Never transformer-engine on CPU.
  "$venv/bin/python" - "$repo/pyproject.toml" > "$venv/deps.txt" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PY
  "$venv/bin/python" -m pip install -q -c "$repo/requirements/constraints.txt" -r "$venv/deps.txt" >&2
  touch "$(stamp base)"
fi
if [ "$extra" = "--test" ] && [ ! -f "$(stamp test)" ]; then
  test_deps=$("$venv/bin/python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["test"]))
PY
)
  echo "[env] adding test extra to $venv" >&2
  echo "$test_deps" > "$venv/test-deps.txt"
  "$venv/bin/python" -m pip install -q -c "$repo/requirements/constraints.txt" -r "$venv/test-deps.txt" >&2
  if "$venv/bin/python" -c 'import transformer_engine' 2>/dev/null || "$venv/bin/python" -m pip show -q transformer-engine >/dev/null 2>&1; then
    echo "error: transformer-engine found in the CPU venv $venv; it breaks 'import megatron.core'" >&2; exit 1
  fi
  touch "$(stamp test)"
fi
# System packages the tests use, from Debian's packages where we may install (apt-get, as root or sudo):
# Open MPI for the mpirun tests; Slurm (slurm-wlm + munge), iproute2 and util-linux (ip, unshare, nsenter)
# for the multi-node Slurm tests (a cluster of network namespaces: tools/netns_cluster.py).
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
{ command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; } || need+=(slurm-wlm munge)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
{ command -v unshare >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1; } || need+=(util-linux)
if [ "$extra" = "--test" ] && [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo -n"
    echo "[env] installing ${need[*]} (apt-get) for the mpirun and Slurm tests" >&2
    { DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q "${need[@]}" \
        || { $sudo_ apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q "${need[@]}"; }; } >&2 \
      || echo "[env] warning: could not install ${need[*]}; the tests that need them will be skipped, saying so" >&2
  else
    echo "[env] warning: ${need[*]} missing and no apt-get/root to install them; the mpirun / Slurm tests will be skipped" >&2
  fi
fi
echo "$venv"
