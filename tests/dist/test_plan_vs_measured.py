"""The memory planner against measurement (tools/plan_vs_measured.py): the step's peak above the
parameters, planned (planner/memory.step_peak_bytes) and measured, each within 10%.
  - the 10 H200 rows of bench_results/h200_qwen27b_4layer_bench.json (Qwen3.6-27B at its real width,
    4 layers, bf16, P 8K-128K, G 2 and 8, detached and exact; measured by the CUDA allocator);
  - 8 CPU points measured here on 2 gloo ranks (PyTorch's profiler counts every tensor allocation):
    the tiny Qwen config in float32, bfloat16 and float64, a 16K vocabulary (the log-prob chunk
    dominates), TP=2, CP=2, both modes; and the tiny GLM-5.2 (MLA + DSA + MoE) in exact mode, which
    the planner underestimates by about 12% (its MLA and MoE backward transients are not modelled yet):
    held to 15% so that it cannot drift unseen, and reported as outside the 10% in the README;
  - 4 adapter points (LoRA and QLoRA nf4 on the frozen base, both modes, TP=1 and TP=2). The planner
    counts a trainable base's saved tensors; with the base frozen autograd keeps less (no normalised
    output for a frozen norm weight, ...: measured 9% less for a Gated DeltaNet layer, 13% for an
    attention layer), so these plans are upper bounds: held to planned >= measured and within 15%;
  - 9 memory-switch points (config/memory.py: recompute, state offload, fp8 state, GLM query blocks;
    P=1,200 where the state matters), device and host bytes apart (how a CPU tells them apart: the
    tool's docstring): the host side within 10% everywhere, the device side within 10% except
    KNOWN_GAPS below; and memory.optimizer_offload's host bytes (the micro_step master shards, Adam's
    moments, the gradient shards at the update) after a train step, f32 and bf16, within 10%."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


# memory-switch rows the planner does not yet meet within 10% (printed, not asserted; issue 22 stays open
# on them), all over (the plan an upper bound): layer recompute on the tiny hybrid, detached 1.14x and
# exact 1.13x measured (the planner counts the recomputed layer's whole saved-tensor sum and gradients
# of its size, more than the layer holds at once); GLM detached with recompute and query blocks 1.43x.
KNOWN_GAPS = ("qwen tiny f32 detached, recompute=layer", "qwen tiny f32 exact chunk 96, recompute=layer",
              "glm tiny f32 detached (4 layers), recompute + MLA query blocks of 16")


def test_planner_within_10_percent_of_measured_peaks():
    from plan_vs_measured import cpu_rows, h200_rows, optimizer_rows, optimizer_table, table

    opt = optimizer_rows()  # memory.optimizer_offload: the micro_step shards' host bytes after a step
    print("\n" + optimizer_table(opt))
    assert len(opt) == 2
    for r in opt:
        assert abs(r["planned_host_bytes"] / r["measured_host_bytes"] - 1) <= 0.10, r

    rows = h200_rows() + cpu_rows()
    print("\n" + table(rows))
    assert len(rows) >= 28
    for r in rows:  # the host side (memory.state_offload): the state's homes and their exact-mode gradients
        if r.get("measured_host_bytes"):
            assert abs(r["planned_host_bytes"] / r["measured_host_bytes"] - 1) <= 0.10, r
    gaps = [r for r in rows if r["name"] in KNOWN_GAPS]
    assert len(gaps) == len(KNOWN_GAPS)
    for r in gaps:
        print(f"known gap: {r['name']}: planned / measured {r['planned_bytes'] / r['measured_bytes']:.3f}")
    rows = [r for r in rows if r["name"] not in KNOWN_GAPS]
    for r in rows:
        ratio = r["planned_bytes"] / r["measured_bytes"]
        adapter = "LoRA" in r["name"]
        tol = 0.15 if r["name"].startswith("glm") or adapter else 0.10
        assert abs(ratio - 1) <= tol, (r["name"], r["where"], r["P"], r["planned_bytes"], r["measured_bytes"])
        assert not adapter or ratio >= 1.0, (r["name"], ratio)
    assert sum(abs(r["planned_bytes"] / r["measured_bytes"] - 1) <= 0.10 for r in rows) >= 26
