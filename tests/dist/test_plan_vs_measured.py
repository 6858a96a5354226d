"""The memory planner against measurement (tools/plan_vs_measured.py): the step's peak above the
parameters, planned (planner/memory.step_peak_bytes) and measured, each within 10%.
  - the 10 H200 rows of bench_results/h200_qwen27b_4layer_bench.json (Qwen3.6-27B at its real width,
    4 layers, bf16, P 8K-128K, G 2 and 8, detached and exact; measured by the CUDA allocator);
  - 8 CPU points measured here on 2 gloo ranks (PyTorch's profiler counts every tensor allocation):
    the tiny Qwen config in float32, bfloat16 and float64, a 16K vocabulary (the log-prob chunk
    dominates), TP=2, CP=2, both modes; and the tiny GLM-5.2 (MLA + DSA + MoE) in exact mode, whose
    peak is the sweep's recompute at the third layer's DSA indexer (its score blocks beside the first two
    layers' saved tensors: planner/memory.py phase_bytes `forward`), within 10% like every row;
  - 4 adapter points (LoRA and QLoRA nf4 on the frozen base, both modes, TP=1 and TP=2), within 10%:
    the planner counts what a frozen base does not keep and what the adapters add
    (planner/adapters.py frozen_base_activation_delta);
  - 9 memory-switch points (config/memory.py: recompute, state offload, fp8 state, GLM query blocks;
    P=1,200 where the state matters), device and host bytes apart (how a CPU tells them apart: the
    tool's docstring): the host side and the device side within 10% everywhere (GLM's too: the capture
    and the recomputed layer's moments are modelled, with the indexer run again beside its output's
    gradient and the RNG state each query block's checkpoint keeps, planner/memory.py phase_bytes); and
    memory.optimizer_offload's host bytes (the micro_step master shards, Adam's
    moments, the gradient shards at the update) after a train step, f32 and bf16, within 10%;
  - the CPU points run ops.attention=auto, torch's fused CPU op; 3 points on the attention kernels' own
    moments: a model of attention layers only in bfloat16 (flash's capture: no score blocks, the op's
    float32 copies), and the plain twin (ops.attention=plain) at P=1,200 (its score blocks in the
    capture) and in exact mode under recompute (in the backward), each within 10%;
  - 3 points through train.grad_reduction=micro_step's holder (train/zero2.py): without and with
    memory.grad_offload (detached f32; exact bf16 with recompute), the host side (staged gradients and
    shards) and the device side (the buckets, what autograd is making) within 10%;
  - the points above one branch per replay micro-step; 3 points with two branches per micro-step
    (replay.batch_tokens = 2 R, G = 4: detached, a 16K vocabulary, exact under recompute with the plain
    twin's score blocks): the planner's micro-step of the budget's tokens within 10% (why the points
    run two micro-steps and not one: the tool's docstring)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_planner_within_10_percent_of_measured_peaks():
    from plan_vs_measured import cpu_rows, h200_rows, optimizer_rows, optimizer_table, table

    opt = optimizer_rows()  # memory.optimizer_offload: the micro_step shards' host bytes after a step
    print("\n" + optimizer_table(opt))
    assert len(opt) == 2
    for r in opt:
        assert abs(r["planned_host_bytes"] / r["measured_host_bytes"] - 1) <= 0.10, r

    rows = h200_rows() + cpu_rows()
    print("\n" + table(rows))
    assert len(rows) >= 40
    for r in rows:  # the host side (memory.state_offload): the state's homes and their exact-mode gradients
        if r.get("measured_host_bytes"):
            assert abs(r["planned_host_bytes"] / r["measured_host_bytes"] - 1) <= 0.10, r
    for r in rows:
        ratio = r["planned_bytes"] / r["measured_bytes"]
        assert abs(ratio - 1) <= 0.10, (r["name"], r["where"], r["P"], r["planned_bytes"], r["measured_bytes"])
