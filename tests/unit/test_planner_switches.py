"""The planner's memory switches (config/memory.py) against bytes computed by hand from their formulas
(planner/memory.py, planner/state.py): fp8 state is fp8_nbytes per tensor of the position-sized
categories, state offload moves exactly those (and, in exact mode, their gradients) to the host and
stages one layer's state in the model dtype, recompute leaves every layer's input plus one recomputed
layer, optimizer offload moves the optimizer term and a float32 gradient shard to the host, gradient
offload moves the micro-step's gradient and the shards to the host and leaves one bucket, MLA query
blocks cap the per-query top-k terms; the time model's added terms (planner/timing.py); the host limit
in `fits` and in the largest P; `plan --suggest`: the five published configs fit and carry its choices,
and with nothing that fits it names the closest plan and the GiB it misses (exit 2). All in this
process: no ranks are spawned. What it does not cover: the runtime's measured bytes with the switches
on (tools/plan_vs_measured.py)."""

from __future__ import annotations

import json
import math
import os

from test_planner import _plan_cli  # the plan command line in-process, one home

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q27 = os.path.join(ROOT, "configs/qwen3.6-27b.yaml")
P = 2_088_960
CAPTURED = -(-(P - 1) // 2)  # tp=4 x cp=2: this rank's positions
GIB = 2**30


def _cfg(path, *overrides):
    from longstraw_mcore.config import load_config

    return load_config(path if os.path.isabs(path) else os.path.join(ROOT, path), list(overrides))


def _both(cfg, P, R, G, gpus):
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import plan_both

    return plan_both(get_family(cfg.model.family), cfg, P, R, G, gpus, cuda=True)


def _qwen(*overrides):
    return _cfg(Q27, "parallel.tp=4", "parallel.cp=2", "memory.recompute=layer", *overrides)


def test_fp8_and_offload_move_exactly_the_position_sized_state():
    from longstraw_mcore.memory.fp8 import fp8_nbytes

    # Qwen3.6-27B at tp=4 x cp=2: 16 attention layers keep K and V, one KV head (256 values) per rank;
    # 48 Gated DeltaNet layers keep a conv window (3 x 2560 bf16) and a recurrent state (12 x 128 x 128 fp32)
    kv = 16 * 2 * 256 * CAPTURED * 2
    kv8 = 16 * 2 * fp8_nbytes(CAPTURED, 256)
    assert kv8 == 16 * 2 * CAPTURED * 2 * 132  # two blocks of 128 values + a float32 scale each
    gdn = 48 * (3 * 2560 * 2 + 12 * 128 * 128 * 4)
    one_layer = 2 * 256 * CAPTURED * 2  # the staged copy: one attention layer's K and V in bf16
    plans = {name: _both(_qwen(*ov), P, 8192, 8, 8) for name, ov in {
        "resident": (), "fp8": ("memory.state_dtype=fp8",), "offload": ("memory.state_offload=true",),
        "both": ("memory.state_offload=true", "memory.state_dtype=fp8")}.items()}
    want = {"resident": (kv + gdn, 0), "fp8": (kv8 + gdn, 0), "offload": (gdn, kv), "both": (gdn, kv8)}
    for name, (device, host) in plans.items():
        assert (device["prompt_state"], host["prompt_state"]) == want[name], name
        assert sum(host.values()) == host["prompt_state"], name  # nothing else moves
        staged = 0 if name == "resident" else one_layer
        assert device["activations"] == plans["resident"][0]["activations"] + staged, name
        for k in ("weights", "gradients", "optimizer"):
            assert device[k] == plans["resident"][0][k], (name, k)


def test_glm_fp8_latents_by_tensor():
    from longstraw_mcore.memory.fp8 import fp8_nbytes
    from longstraw_mcore.prompt_state.mla import MLAIndexerState

    cfg = _cfg("configs/glm-5.2.yaml", "parallel.cp=4", "parallel.ep=32", "memory.recompute=layer",
               "memory.state_dtype=fp8")
    rows = -(-(2_097_152 - 1) // 4)
    # c (512 values: 4 blocks) and pe (64: one block) on all 78 layers, the index key (128) on the 21
    # full indexer layers: fp8 unless the kind keeps it exact (memory/staging.py: it decides the top-k)
    ik = rows * 128 * 2 if "ik" in getattr(MLAIndexerState, "exact_rows", ()) else fp8_nbytes(rows, 128)
    device, host = _both(cfg, 2_097_152, 1024, 2, 32)
    assert device["prompt_state"] == 78 * (fp8_nbytes(rows, 512) + fp8_nbytes(rows, 64)) + 21 * ik
    assert fp8_nbytes(rows, 512) + fp8_nbytes(rows, 64) == rows * 660 and sum(host.values()) == 0


def test_exact_offload_moves_the_position_sized_gradients():
    cfg = _qwen("replay.mode=exact", "memory.state_offload=true")
    device, host = _both(cfg, P, 8192, 8, 8)
    chunks = -(-(P - 1) // cfg.replay.chunk_len)
    per_gdn = 3 * 2560 * 2 + 12 * 128 * 128 * 4
    # device: GDN's final state and its exact-mode chunk boundaries (1/cp each), and its state leaves'
    # float32 gradients (conv, recurrent, and the conv's float32 copy); host: K/V and their float32 accumulators
    assert device["prompt_state"] == 48 * (per_gdn + per_gdn // 2 * (chunks - 1))
    assert device["prompt_state_grad"] == 48 * (7680 + 196608 + 7680) * 4
    assert host["prompt_state"] == 16 * 2 * 256 * CAPTURED * 2
    assert host["prompt_state_grad"] == 16 * 2 * 256 * CAPTURED * 4


def test_recompute_keeps_each_layers_input_and_one_layer():
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.activations import (attention_score_blocks, attention_scratch_bytes, gdn_backward_scratch,
                                                     gdn_capture_bytes, layer_bytes, mlp_moment_bytes,
                                                     zero_centred_norm_bytes)
    from longstraw_mcore.planner.memory import phase_bytes
    from longstraw_mcore.prompt_state.containers import analytic_state_grad_bytes

    Pt, R, G = 300, 40, 2
    for mode in ("detached", "exact"):  # one branch of R tokens per micro-step (the budget's batch: test_planner.py)
        base = _cfg("configs/qwen3.6-tiny.yaml", f"replay.mode={mode}", "replay.batch_tokens=0")
        rec = _cfg("configs/qwen3.6-tiny.yaml", f"replay.mode={mode}", "memory.recompute=layer", "replay.batch_tokens=0")
        fam, m = get_family("qwen3_5"), base.model
        L, Hd, e, V = m.num_layers, m.hidden_size, 4, m.padded_vocab_size(1)
        cap, chunk = Pt - 1, min(base.replay.chunk_len, Pt - 1)
        one_grad = max(analytic_state_grad_bytes(fam.layers, m, 1, cap, [t]) for t in set(m.layer_types)) \
            if mode == "exact" else 0
        per = [layer_bytes(fam.layers, m, 1, R, i, cap + R) for i in range(L)]
        logits = max(R * V * 12, R * V * e + V * Hd * e)  # float32: logits, shifted, exp / their grad + lm_head's
        norm = R * zero_centred_norm_bytes(Hd, e)
        got0 = phase_bytes(fam, base, Pt, R, G, range(L), True)
        got = phase_bytes(fam, rec, Pt, R, G, range(L), True)
        assert got0["replay"] == sum(per) + max(max(per), logits) + norm + one_grad
        # one layer's backward at a time: its recomputed saved tensors and what its backward makes (attention:
        # its score blocks recomputed from the log-sum-exp over the prompt's rows; Gated DeltaNet: its maps' gradients)
        bwd = [per[i] + (attention_score_blocks(m, R, cap, 1) if m.layer_types[i] == "full_attention"
                         else gdn_backward_scratch(m, R)) for i in range(L)]
        assert got["replay"] == L * R * Hd * e + max(max(bwd), logits) + norm + one_grad
        assert got["capture"] == got0["capture"]
        if mode == "exact":
            # a layer run again with autograd: the larger of its forward's capture moment (attention: the
            # capture's score blocks and what is alive beside them, or the MLP's; Gated DeltaNet: its
            # rule's end) and its backward's (its saved tensors and, attention, the score blocks
            # recomputed from the log-sum-exp)
            def sweep_layer(i):
                own = layer_bytes(fam.layers, m, 1, chunk, i, cap, produce_only=i == L - 1)
                if m.layer_types[i] != "full_attention":
                    return max(gdn_capture_bytes(m, chunk, cap, 1), own + gdn_backward_scratch(m, chunk))
                moment = max(attention_scratch_bytes(m, chunk, cap, 1), mlp_moment_bytes(m, chunk, 1))
                return max(moment, own + attention_score_blocks(m, chunk, cap, 1))
            sweep = max(sweep_layer(i) for i in range(L))
            assert got["prompt_backward"] == L * chunk * Hd * e + sweep + one_grad


def test_optimizer_offload_moves_the_optimizer_and_adds_a_gradient_shard():
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.weights import stage_weights

    # sharded over data x context parallel (2 ranks here) either way: micro_step's own shards, or under
    # step reduction Megatron's distributed optimizer, which HybridDeviceOptimizer needs (RunConfig.
    # uses_distributed_optimizer); without offload, step reduction keeps the whole optimizer per rank
    for red, plain_shards in (("micro_step", 2), ("step", 1)):
        cfg = _cfg(Q27, "parallel.tp=4", "parallel.cp=2", f"train.grad_reduction={red}",
                   "memory.optimizer_offload=true")
        assert cfg.uses_distributed_optimizer() == (red == "step")
        n = stage_weights(get_family("qwen3_5"), cfg, [64], 0)[1]
        device, host = _both(cfg, 65_536, 1024, 8, 8)
        plain, _ = _both(_cfg(Q27, "parallel.tp=4", "parallel.cp=2", f"train.grad_reduction={red}"), 65_536, 1024, 8, 8)
        assert device["optimizer"] == 0 and device["gradients"] == plain["gradients"]
        assert host["optimizer"] == -(-n * 12 // 2)  # moments + float32 master (bf16)
        assert plain["optimizer"] == -(-n * 12 // plain_shards)
        assert host["optimizer_grads"] == -(-n * 4 // 2)


def test_grad_offload_leaves_one_bucket_on_the_device():
    """memory.grad_offload (micro_step): the micro-step's gradient (n x e) and the float32 shards move to
    the host; the device keeps one bucket's send buffer and reduce-scatter output, whose size is the
    bucket limit plus at most the largest parameter (the padded output layer's TP shard here), or the
    shards' copy an optimizer on the device updates from; the time model adds 2 x n x e over PCIe per
    micro-step (the replay's under replay.batch_tokens, + the chunks in exact mode)."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.weights import stage_weights
    from longstraw_mcore.planner.timing import PCIE_BYTES_PER_S, plan_time

    layout = ("parallel.tp=4", "parallel.cp=2", "train.grad_reduction=micro_step")
    cfg = _cfg(Q27, *layout, "memory.grad_offload=true", "memory.optimizer_offload=true")
    m = cfg.model
    n = stage_weights(get_family("qwen3_5"), cfg, [64], 0)[1]
    H20 = device_profile("H20-96GB")
    device, host = _both(cfg, 65_536, 1024, 8, 8)
    resident, resident_host = _both(_cfg(Q27, *layout, "memory.optimizer_offload=true"), 65_536, 1024, 8, 8)
    assert host["gradients"] == n * 2 and host["gradient_shards"] == -(-n * 4 // 2)  # bf16 gradient, f32 shards
    assert resident_host["gradients"] == 0 and "gradient_shards" not in resident_host
    largest = m.padded_vocab_size(4) * m.hidden_size // 4
    bucket = 64 * 2**20 + largest * 4
    assert device["gradients"] == bucket + bucket // 2, (device["gradients"], bucket)
    assert resident["gradients"] >= -(-n * 4 // 2) + bucket  # the shards and the buckets on the device
    assert {k: v for k, v in device.items() if k != "gradients"} == \
        {k: v for k, v in resident.items() if k != "gradients"} | {"allocator_slack": device["allocator_slack"]}
    on_device = _cfg(Q27, *layout, "memory.grad_offload=true")  # the update reads the shards on the device
    assert _both(on_device, 65_536, 1024, 8, 8)[0]["gradients"] == max(bucket + bucket // 2, -(-n * 4 // 2))
    chunks = -(-(65_536 - 1) // cfg.replay.chunk_len)
    # G = 8 branches of 1,024 tokens: one per micro-step at a budget of 0, 4 + 4 at 4,096, all at 8,192
    for mode, budget, micro in (("detached", 0, 8), ("detached", 4096, 2), ("detached", 8192, 1),
                                ("exact", 0, 8 + chunks), ("exact", 8192, 1 + chunks)):
        c = _cfg(Q27, *layout, "memory.grad_offload=true", "memory.optimizer_offload=true", f"replay.mode={mode}",
                 f"replay.batch_tokens={budget}")
        h = _both(c, 65_536, 1024, 8, 8)[1]
        t = plan_time(get_family("qwen3_5"), c, 65_536, 1024, 8, 8, H20, 0.05, h)["seconds"]
        assert math.isclose(t["grad_transfer"], 2 * n * 2 * micro / PCIE_BYTES_PER_S), (mode, budget, t)


def test_mla_query_block_caps_the_per_query_topk_terms():
    from longstraw_mcore.planner.activations import mla_bytes

    m = _cfg("configs/glm-5.2.yaml").model
    T, keys, B = 1024, 100_000, 512
    k, h, e, w = 2048, 64, 2, 4
    per_query = k * 8 + k * (512 + 64) * e + k + h * k * (w + e)  # indices, selected latents, mask, softmax
    assert mla_bytes(m, 1, T, keys) - mla_bytes(m, 1, T, keys, B) == (T - B) * per_query
    assert mla_bytes(m, 1, 300, keys, B) == mla_bytes(m, 1, 300, keys)


def test_time_model_terms():
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.flops import forward_flops, step_flops
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.timing import CPU_ADAM_BYTES_PER_S, PCIE_BYTES_PER_S, plan_time

    fam = get_family("qwen3_5")
    H20 = device_profile("H20-96GB")
    Pt, R, G, peak = 65_536, 1024, 4, H20.bf16_flops * 0.05  # --efficiency 0.05: one figure for every phase
    cfg = _qwen("memory.state_offload=true", "memory.optimizer_offload=true", "train.grad_reduction=micro_step")
    device, host = _both(cfg, Pt, R, G, 8)
    t = plan_time(fam, cfg, Pt, R, G, 8, H20, 0.05, host)
    local = -(-(Pt - 1) // 2) + 1
    n, S = -(-(Pt - 1) // cfg.replay.chunk_len), host["prompt_state"]
    assert S > 0 and t["flops"]["recompute"] == forward_flops(fam.layers, cfg.model, local, [R] * G, 4)
    assert math.isclose(t["seconds"]["recompute"], t["flops"]["recompute"] / peak)
    # passes: G x R = 4,096 tokens is one micro-step under the default budget, G of them at 0
    assert cfg.replay.batch_tokens >= G * R
    assert math.isclose(t["seconds"]["state_transfer"], ((n + 1) / 2 * S + 1 * 2 * S) / PCIE_BYTES_PER_S)
    one_each = _qwen("memory.state_offload=true", "memory.optimizer_offload=true", "train.grad_reduction=micro_step",
                     "replay.batch_tokens=0")
    t1 = plan_time(fam, one_each, Pt, R, G, 8, H20, 0.05, _both(one_each, Pt, R, G, 8)[1])
    assert math.isclose(t1["seconds"]["state_transfer"], ((n + 1) / 2 * S + G * 2 * S) / PCIE_BYTES_PER_S)
    O, Gh = host["optimizer"], host["optimizer_grads"]
    assert math.isclose(t["seconds"]["optimizer_offload"],
                        (Gh + Gh / 4 * 2) / PCIE_BYTES_PER_S + (O + Gh) / CPU_ADAM_BYTES_PER_S)
    assert math.isclose(t["seconds"]["total"], sum(v for k, v in t["seconds"].items() if k != "total"))
    # no switch, one rank of context: the phases are step_flops' own, and nothing is added
    plain = _cfg(Q27, "parallel.tp=4")
    t0 = plan_time(fam, plain, Pt, R, G, 4, H20, 0.05, _both(plain, Pt, R, G, 4)[1])
    ref = step_flops(fam.layers, plain.model, Pt, [R] * G, "detached", plain.replay.chunk_len, 4)["algorithm"]
    assert t0["flops"] == {"capture": ref["capture"], "replay": ref["replay"]}
    assert set(t0["seconds"]) == {"capture", "replay", "total"}


def test_host_limit_decides_fits_and_the_largest_prompt():
    from longstraw_mcore.commands.plan import plan
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import plan_host

    cfg = _qwen("memory.state_offload=true")
    res = plan(cfg, P, 8192, 8, 8, "H20-141GB", None, 0.05, host_gib=64, gpus_per_node=8)
    per_node = res["total_host_per_rank_bytes"] * 8
    assert res["host_per_node_bytes"] == per_node > 64 * GIB and res["fits_device"] and not res["fits"]
    mx = res["max_prompt_len"]
    fam = get_family("qwen3_5")
    assert sum(plan_host(fam, cfg, mx, 8192, 8, 8).values()) * 8 <= 64 * GIB
    assert sum(plan_host(fam, cfg, mx + 1, 8192, 8, 8).values()) * 8 > 64 * GIB
    rc, out, _ = _plan_cli("--config", Q27, "--prompt-len", "65536", "--response-len", "512", "--group-size", "2",
                           "--gpus", "4", "--gpus-per-node", "2", "--device", "H20-141GB", "--json",
                           "parallel.tp=4", "memory.recompute=layer", "memory.state_offload=true")
    got = json.loads(out)
    assert rc == 0 and got["inputs"]["gpus_per_node"] == 2 and got["device_bytes"] == 141 * 10**9
    assert got["host_per_node_bytes"] == 2 * got["total_host_per_rank_bytes"] > 0
    for argv, want in [(("--host-gib", "0"), "--host-gib 0.0: must be > 0"),
                       (("--gpus-per-node", "0"), "--gpus-per-node 0: must be a positive integer")]:
        rc, _, err = _plan_cli("--config", Q27, "--prompt-len", "4096", "--response-len", "256", "--group-size", "2",
                               "--gpus", "4", *argv, "parallel.tp=4")
        assert rc == 2 and want in err, (argv, err)


PUBLISHED = [  # (config, P, R, G, GPUs, device)
    ("qwen3.6-27b-qlora-2m-8xh20-96gb", 2_088_960, 8192, 8, 8, "H20-96GB"),
    ("qwen3.6-27b-qlora-4.46m-8xh20-141gb", 4_456_448, 8192, 8, 8, "H20-141GB"),
    ("qwen3.6-27b-qlora-exact-2m-8xh20-141gb", 2_088_960, 8192, 8, 8, "H20-141GB"),
    ("qwen3.6-27b-full-2m-16xh20-96gb", 2_097_152, 1024, 8, 16, "H20-96GB"),
    ("glm-5.2-lora-2m-32xh20-141gb", 2_097_152, 1024, 2, 32, "H20-141GB"),
]


def test_published_configs_fit_with_the_suggested_layout_and_switches():
    """Each config under configs/published/ fits its point by `suggest`, and what the search chose is
    what the config sets (its layout, memory section and gradient reduction)."""
    import dataclasses

    from longstraw_mcore.config import config_to_dict
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.devices import device_profile
    from longstraw_mcore.planner.suggest import suggest

    for name, Pp, R, G, gpus, dev in PUBLISHED:
        cfg = _cfg(f"configs/published/{name}.yaml")
        found = suggest(get_family(cfg.model.family), config_to_dict(cfg), Pp, R, G, gpus, device_profile(dev), None,
                        2048 * GIB, 8)  # the device table's figures (planner/efficiency.py), as `plan` runs it
        best = found["best"]
        assert found["fits"] and not best.misses, (name, best.misses)
        assert best.device_bytes <= device_profile(dev).memory_bytes and best.host_node_bytes <= 2048 * GIB
        assert dataclasses.asdict(best.cfg) == dataclasses.asdict(cfg), (name, best.overrides)


def test_suggest_cli_json_and_nothing_fits():
    tiny = os.path.join(ROOT, "configs/qwen3.6-tiny.yaml")
    base = ["--config", tiny, "--prompt-len", "4096", "--response-len", "64", "--group-size", "2", "--gpus", "2",
            "--suggest"]
    rc, out, _ = _plan_cli(*base, "--json")
    got = json.loads(out)
    assert rc == 0 and got["fits"] and got["suggest"]["fits"] and got["suggest"]["plan"]["fits"]
    ov = got["suggest"]["overrides"]
    assert any(o.startswith("parallel.tp=") for o in ov) and "memory.mla_query_block=0" in ov
    rc, out, _ = _plan_cli(*base)
    assert rc == 0 and out.startswith("suggest: tp=") and "overrides: parallel.tp=" in out
    rc, out, err = _plan_cli(*base, "--device-gib", "0.001", "--host-gib", "0.001")
    assert rc == 2 and "error: --suggest: nothing fits 2 x H20-96GB among" in err and "the closest is tp=" in err
    assert "GiB per rank over the device" in err and "(its overrides: parallel.tp=" in err
    miss = float(err.split("the closest is ")[1].split(": ")[1].split(" GiB per rank")[0])
    assert miss > 0


def test_plain_gradients_do_not_exist_while_the_prompt_is_captured():
    """grads="plain" (a model without DDP, as the benches and tools/plan_vs_measured.py run it): the
    capture is set against the later phases without the .grad tensors and state gradients, which are
    made after it; with the training gradients (DDP buffers, alive all step) the worst phase stands."""
    from longstraw_mcore.families import get_family
    from longstraw_mcore.planner.memory import phase_bytes, plan_memory

    fam = get_family("qwen3_5")
    for mode, P in (("detached", 1200), ("exact", 1200), ("exact", 300)):
        cfg = _cfg("configs/qwen3.6-tiny.yaml", f"replay.mode={mode}", "memory.recompute=layer",
                   "ops.attention=plain")  # (the twin's score blocks make the capture the widest phase)
        L = cfg.model.num_layers
        ph = phase_bytes(fam, cfg, P, 64, 2, range(L), True, "cpu")
        plain = plan_memory(fam, cfg, P, 64, 2, 1, cuda=False, grads="plain")
        train = plan_memory(fam, cfg, P, 64, 2, 1, cuda=False)
        later = max(v for k, v in ph.items() if k != "capture")
        assert plain["activations"] == max(later, ph["capture"] - plain["gradients"] - plain["prompt_state_grad"])
        assert train["activations"] == max(ph.values())
        # the step's peak: the state plus the larger of the capture and everything after it
        assert sum(plain[k] for k in ("gradients", "prompt_state_grad", "activations")) == \
            max(ph["capture"], plain["gradients"] + plain["prompt_state_grad"] + later)
    assert ph["capture"] < later  # (the last point: exact at P=300 peaks after the capture)
