#!/usr/bin/env bash
# Build, here (a CPU machine, no GPU), the Hopper (sm_90) Triton kernels scripts/gpu_check.sh takes, and pack them
# for the lent device as OUT/triton-sm90.tar.xz (issue 58). The device then measures instead of compiling.
#
#   bash scripts/gpu_aot.sh OUT [--mode auto|full|pinned] [--only REGEX] [--winners DIR] [--jobs N]
#
# 1. A venv of the device's exact Triton and torch (requirements/gpu-aot.txt; Triton's cache key hashes its own
#    files, so the wheel must be the device's), made once under ~/.cache/longstraw-mcore/ (torch 2.11.0 + CUDA
#    libraries: about 4 GB, a few minutes where the registry is near).
# 2. tools/gpu_aot.py: every path of the check (fla's Gated DeltaNet and KDA, the DSA kernels, fla as transformers
#    calls it) on CPU tensors under a stand-in Hopper driver, compiling into /tmp/longstraw-triton-sm90 (the one
#    path the device uses: Triton's group files name absolute paths), in --jobs processes (default 2).
#    full: every autotune config (the device benchmarks, compiles nothing); pinned: one config per kernel and key
#    with Triton's autotune record (the device neither benchmarks nor compiles); auto: pinned once the device's
#    winners are committed (bench_results/*_autotune/), else full.
# 3. Then: cp OUT/triton-sm90.tar.xz .triton/ and carry .triton with .whl (scripts/gpu_check.sh's header).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || { echo "usage: bash scripts/gpu_aot.sh OUT [--mode auto|full|pinned] [--only REGEX] [--winners DIR] [--jobs N]" >&2; exit 2; }
out="$1"; shift
root="${LONGSTRAW_VENV_ROOT:-$HOME/.cache/longstraw-mcore}"
hash=$(sha256sum "$repo/requirements/gpu-aot.txt" | cut -c1-12)
venv="$root/aot-venv-$hash"
mkdir -p "$root"
exec 9>"$root/.lock-aot-$hash"
flock 9
if [ ! -f "$venv/.ready" ]; then
  rm -rf "$venv"
  py=python3.12  # (as scripts/env.sh finds it: on PATH, else pyenv's 3.12.1)
  python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 \
    || py="env PYENV_VERSION=3.12.1 pyenv exec python3.12"
  echo "[gpu_aot] creating $venv (the device's torch 2.11.0 and triton 3.6.0, ~4 GB: a few minutes once)" >&2
  $py -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-deps -r "$repo/requirements/gpu-aot.txt" >&2
  "$venv/bin/python" -c 'import torch, triton, fla; assert torch.__version__.startswith("2.11.0") and triton.__version__ == "3.6.0"' >&2
  touch "$venv/.ready"
fi
exec 9>&-
echo "[gpu_aot] $("$venv/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')" >&2
PYTHONPATH="$repo" exec "$venv/bin/python" "$repo/tools/gpu_aot.py" "$out" "$@"
