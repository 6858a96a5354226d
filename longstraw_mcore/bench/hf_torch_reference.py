"""Importing this module binds transformers' Qwen3.5 modeling to its own torch Gated DeltaNet rule
(bench/hf_kernels.py: `qwen3_5_modeling(fla=False)`), for a process that preloads modules by name: the
fork server of launch_local.run_ranks, whose ranks build the transformers references."""

from longstraw_mcore.bench.hf_kernels import qwen3_5_modeling

qwen3_5_modeling(fla=False)
