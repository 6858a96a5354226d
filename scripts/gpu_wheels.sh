#!/usr/bin/env bash
# Download (here, where the package registry is reachable) the wheels a bare CUDA image lacks for
# scripts/gpu_check.sh, into .whl/ (git-ignored): megatron-core, pinned as in requirements/constraints.txt,
# torchao (QLoRA's NF4 base, adapters/quant.py; the image has none), pinned likewise, and fla-core (the `fla`
# package of flash-linear-attention, pure Python, 1.1 MB), pinned as in pyproject's gpu extra: it runs on
# any triton >= 3.3 (on Hopper with triton 3.4-3.7.0 for key dims > 64 only: ops/fla_gdn.py, fla issue #640).
# The image is expected to carry torch, triton, transformers, safetensors, einops, psutil, pyyaml, pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pins=$(grep -E '^(megatron-core|torchao)==' "$repo/requirements/constraints.txt")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d "$repo/.whl" $pins
fla=$(grep -oE 'fla-core==[0-9.]+' "$repo/pyproject.toml" | head -1)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$repo/.whl" "$fla"
ls -la "$repo/.whl"
