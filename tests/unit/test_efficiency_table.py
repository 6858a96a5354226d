"""The time model's device table (planner/efficiency.py) and its use (planner/timing.py, `longstraw plan`):
the H200 figures recomputed from the bench files they cite, so the table cannot drift from its source;
an H200 plan of the benches' own points gives their measured phase seconds back; every other device's
figure is the docstring's rule applied to the H200's; the lookup by kernels (fla and the plain attention
twin stand in with the measured figures and say so); plan_time per phase against seconds by hand;
`--efficiency F` one figure for every phase; `plan --json` and the table carry each figure's source.
Not covered: whether the derived H20 / H100 figures hold on those devices (no measurement there)."""

from __future__ import annotations

import json
import math
import os

import pytest

from test_planner import _plan_cli  # the plan command line in-process, one home

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q27 = os.path.join(ROOT, "configs/qwen3.6-27b.yaml")


def _cfg(path, *overrides):
    from longstraw_mcore.config import load_config

    return load_config(os.path.join(ROOT, path), list(overrides))


def _bench_row(file):
    with open(os.path.join(ROOT, file)) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == 1, file
    return rows[0]


def test_measured_figures_are_their_files_flops_over_seconds_over_the_peak():
    from longstraw_mcore.planner.devices import DEVICE_PROFILES
    from longstraw_mcore.planner.efficiency import MEASURED, MEASURED_DEVICE

    peak = DEVICE_PROFILES[MEASURED_DEVICE].bf16_flops
    seen = set()
    for m in MEASURED:
        row = _bench_row(m.file)
        assert row["mode"] == m.mode, (m, row["mode"])
        got = row["flops_algorithm"][m.phase] / row["phase_seconds"][m.phase] / peak
        assert math.isclose(m.value, got, rel_tol=1e-4), (m, got)
        seen.add((m.file, m.phase))
    for file in {m.file for m in MEASURED}:  # every timed phase of each file is in the table
        assert {(file, k) for k in _bench_row(file)["phase_seconds"] if k != "total"} <= seen, file


def test_an_h200_plan_of_the_bench_points_gives_their_measured_seconds():
    """The benches ran the planner's own FLOP count (tools/bench_replay.py: step_flops), one rank, no
    pipeline bubble, so the table's figure times each phase at its measured seconds."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.efficiency import DETACHED_128K, EXACT_32K
    from longstraw_mcore.planner.timing import plan_time

    h200 = device_profile("H200-141GB")
    for file in (DETACHED_128K, EXACT_32K):
        row = _bench_row(file)
        cfg = _cfg("configs/qwen3.6-27b.yaml", "model.num_layers=4", "parallel.tp=1", f"replay.mode={row['mode']}",
                   f"replay.chunk_len={row['chunk_len']}")
        t = plan_time(get_family("qwen3_5"), cfg, row["P"], row["R"], row["G"], 1, h200, None, {})
        for phase, secs in row["phase_seconds"].items():
            if phase != "total":
                # (the FLOP model moved by 1e-7 since the lease: a count refined after it)
                assert math.isclose(t["flops"][phase], row["flops_algorithm"][phase], rel_tol=1e-6), (file, phase)
                assert math.isclose(t["seconds"][phase], secs, rel_tol=1e-4), (file, phase, t["seconds"][phase], secs)


def test_other_devices_are_the_rule_applied_to_the_h200_figures():
    """e_X = 1 / (1 + (1/e - 1) (F_X / F_H200) (B_H200 / B_X)), with the H20's 148 TFLOP/s and 4.0 TB/s
    against the H200's 989 and 4.8 (the H100: 989 and 3.35): by hand, and from the table."""
    from longstraw_mcore.planner.efficiency import MEASURED, TABLE

    hand = {"H20-96GB": (148e12, 4.0e12), "H20-141GB": (148e12, 4.0e12), "H100-80GB": (989e12, 3.35e12)}
    for m in MEASURED:
        h200 = getattr(TABLE[("H200-141GB", m.mode)], m.phase)
        assert (h200.value, h200.source, h200.basis) == (m.value, "measured", m.file)
        for device, (F, B) in hand.items():
            got = getattr(TABLE[(device, m.mode)], m.phase)
            assert got.source == "derived" and m.file in got.basis
            assert math.isclose(got.value, 1 / (1 + (1 / m.value - 1) * (F / 989e12) * (4.8e12 / B)), rel_tol=1e-12)
            assert m.value < got.value < 1 if device.startswith("H20") else got.value < m.value
    for (device, mode), row in TABLE.items():  # recompute: the capture's figure; the sweep only in exact mode
        assert row.recompute.value == row.capture.value and row.recompute.source == "derived"
        assert (row.prompt_backward is not None) == (mode == "exact")
    # the 2.1M point's capture on the H20: 2.77% on the H200 -> 13.7%
    assert round(TABLE[("H20-96GB", "detached")].capture.value, 4) == 0.1370


def test_lookup_by_kernels_and_bad_names():
    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.planner.efficiency import TABLE, efficiencies, run_kernels

    plain = efficiencies("H20-96GB", "detached", "plain", "flash")
    assert plain.notes == () and plain.phases() == TABLE[("H20-96GB", "detached")].phases()
    fla = efficiencies("H20-96GB", "detached", "fla", "plain")
    assert fla.phases() == plain.phases()  # no fla numbers: the plain rule's, said so
    assert fla.notes == ("no measurement with fla yet: plain-rule figures",
                         "no measurement with the plain attention twin: flash-attention figures")
    for args, want in [(("A100", "detached", "plain", "flash"), "device 'A100' is not known; known: ['H100-80GB'"),
                       (("H20-96GB", "full", "plain", "flash"), "mode 'full' is not known; known: ['detached'"),
                       (("H20-96GB", "exact", "tilelang", "flash"), "gdn kernel 'tilelang' is not known")]:
        with pytest.raises(ConfigError, match=want.replace("[", r"\[").replace("(", r"\(")):
            efficiencies(*args)
    # what a config takes on CUDA: auto is fla for bf16 / fp16 / fp32 Gated DeltaNet, the plain rule when forced;
    # float32 attention runs the twin
    assert run_kernels(_cfg("configs/qwen3.6-27b.yaml")) == {"gdn": "fla", "attention": "flash"}
    assert run_kernels(_cfg("configs/qwen3.6-27b.yaml", "ops.gdn=plain")) == {"gdn": "plain", "attention": "flash"}
    assert run_kernels(_cfg("configs/qwen3.6-tiny.yaml")) == {"gdn": "fla", "attention": "plain"}  # float32
    assert run_kernels(_cfg("configs/qwen3.6-tiny.yaml", "model.dtype=float64"))["gdn"] == "plain"
    assert run_kernels(_cfg("configs/glm-5.2-tiny.yaml"))["gdn"] == "none"


def test_plan_time_per_phase_by_hand_and_the_override():
    """The tiny hybrid, exact mode with layer recompute on one H20-96GB rank (no bubble): each phase's
    FLOPs over the peak times its own figure; recompute (the branches' forward and the chunks') at the
    capture's. --efficiency 0.05: every phase at 5%."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.efficiency import TABLE
    from longstraw_mcore.planner.timing import phase_flops, plan_time

    fam, h20 = get_family("qwen3_5"), device_profile("H20-96GB")
    cfg = _cfg("configs/qwen3.6-tiny.yaml", "replay.mode=exact", "memory.recompute=layer")
    P, R, G = 1000, 32, 4
    flops = phase_flops(fam, cfg, P, R, G)
    assert set(flops) == {"capture", "replay", "prompt_backward", "recompute"}
    row = TABLE[("H20-96GB", "exact")]
    t = plan_time(fam, cfg, P, R, G, 1, h20, None, {})
    for phase, f in flops.items():
        assert math.isclose(t["seconds"][phase], f / (148e12 * getattr(row, phase).value), rel_tol=1e-12), phase
        assert t["efficiency"][phase]["value"] == getattr(row, phase).value
    assert t["efficiency"]["prompt_backward"] == {"value": row.prompt_backward.value, "source": "derived",
                                                  "from": row.prompt_backward.basis}
    assert t["efficiency_notes"] == ["no measurement with fla yet: plain-rule figures",  # (float32: fla on CUDA)
                                     "no measurement with the plain attention twin: flash-attention figures"]
    one = plan_time(fam, cfg, P, R, G, 1, h20, 0.05, {})
    for phase, f in flops.items():
        assert math.isclose(one["seconds"][phase], f / (148e12 * 0.05), rel_tol=1e-12), phase
        assert one["efficiency"][phase]["source"] == "override"
    assert t["seconds"]["total"] < one["seconds"]["total"]  # every H20 figure is above 5%


def test_plan_json_and_table_carry_the_sources():
    from longstraw_mcore.planner.efficiency import DETACHED_128K, EXACT_32K

    base = ["--config", Q27, "--prompt-len", "65536", "--response-len", "512", "--group-size", "4", "--gpus", "4"]
    rc, out, _ = _plan_cli(*base, "--device", "H200-141GB", "--json", "parallel.tp=4")
    got = json.loads(out)
    assert rc == 0 and got["inputs"]["efficiency"] is None
    assert got["inputs"]["kernels"] == {"gdn": "fla", "attention": "flash"}
    assert got["efficiency"]["capture"] == {"value": 0.027720, "source": "measured", "from": DETACHED_128K}
    assert got["efficiency"]["replay"]["source"] == "measured" and set(got["efficiency"]) == {"capture", "replay"}
    assert got["efficiency_notes"] == ["no measurement with fla yet: plain-rule figures"]
    assert got["efficiency_measured_on"].startswith("H200-141GB, 2026-12-04 (committed in 8917b2f)")
    assert got["efficiency_measured_on"].endswith("gdn plain, attention flash")
    rc, out, _ = _plan_cli(*base, "--json", "parallel.tp=4", "replay.mode=exact", "ops.gdn=plain")  # H20-96GB
    got = json.loads(out)
    pb = got["efficiency"]["prompt_backward"]
    assert pb["source"] == "derived" and EXACT_32K in pb["from"] and got["efficiency_notes"] == []
    rc, out, _ = _plan_cli(*base, "--efficiency", "0.05", "--json", "parallel.tp=4")
    got = json.loads(out)
    assert got["inputs"]["efficiency"] == 0.05
    assert {e["value"] for e in got["efficiency"].values()} == {0.05} and got["efficiency_measured_on"] == ""
    rc, out, _ = _plan_cli(*base, "--device", "H200-141GB", "parallel.tp=4")
    assert rc == 0 and f"| 2.77% measured: {DETACHED_128K} |" in out
    assert "efficiency: kernels gdn=fla attention=flash on CUDA; no measurement with fla yet: plain-rule figures" in out
    rc, _, err = _plan_cli(*base, "--efficiency", "1.5", "parallel.tp=4")
    assert rc == 2 and "--efficiency 1.5: must be in (0, 1]" in err
