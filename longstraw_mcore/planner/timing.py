"""The time model of `longstraw plan`: seconds per rank of one group step (each data-parallel rank runs
its own prompt group), from the FLOP model (planner/flops.py) and the memory plan's host bytes
(planner/memory.py). It is a model, not a measurement: each phase's compute at its efficiency, a
fraction of the device's dense bf16 peak from the device table (planner/efficiency.py: measured on one
H200 with the plain Gated DeltaNet rule and flash attention, derived for the H20 and H100 by peak and
HBM bandwidth; `--efficiency F` overrides it with one fraction for every phase), host-device copies and
the CPU optimizer at the constant rates below, nothing overlapped (an upper bound where the runtime
overlaps), no communication.

Per rank, with F a phase's FLOPs on one TP rank (step_flops' algorithm count, the replay's micro-steps
padded to their longest branch under replay.batch_tokens; the capture's and the sweep's summed over the
cp ranks, so Gated DeltaNet by sequence pieces counts its wider rule and every rank's scan:
planner/flops_hybrid.py), peak_x = the device's bf16 FLOP/s x phase x's
efficiency, n the capture chunks, passes = the replay's micro-steps (G branches of R tokens under
replay.batch_tokens: replay/plan.py `even_micro_steps`, the executor's grouping; a prefix tree's
segments and its tails' micro-steps: planner/tree.py `tree_passes`), P_local = ceil((P - 1) / cp) + 1:

    capture          F_capture(P) / (pp cp) / peak_capture x bubble(n)
    replay           F_replay(P_local) / pp / peak_replay x bubble(k): every CP rank replays the
                     branches whole against its shard of the prompt (partial attention merged by
                     log-sum-exp); k = passes, + n in exact mode (the replay and the sweep are one
                     schedule, replay/pipeline.py, with one fill and drain)
    prompt_backward  exact mode: F_sweep(P) / (pp cp) / peak_prompt_backward x bubble(k)
    recompute        memory.recompute=layer: the branches' layers run forward again in the backward,
                     F_forward(P_local) / pp (forward_flops), and in exact mode every chunk's too,
                     F_capture(P) / (pp cp) (its forward), all / peak_recompute x bubble(k) (the table
                     gives recompute the capture's figure: forward work)
    state_transfer   memory.state_offload: bytes over PCIe / PCIE_BYTES_PER_S, with S this rank's
                     host-resident state (as stored: model dtype or fp8) and Sg its host-resident
                     state gradient (exact mode):
                       capture          (n + 1) / 2 x S: chunk c reads every layer's rows so far
                       replay           passes x (2 S + Sg): each layer's state for its forward and its
                                        recompute; exact: its gradient to the host
                       prompt_backward  (n - 1) x S + (n + 1) / 2 x Sg: chunk c reads the rows before it
                                        twice (forward, recompute), adds their gradient, reads its seed
    grad_transfer    memory.grad_offload: every micro-step's gradient to the host as the backward makes it
                     and back bucket by bucket for its reduce-scatter, 2 x Gs / PCIe per micro-step (Gs:
                     the plan's host gradients, n x e), passes micro-steps per group (+ n in exact mode)
    optimizer_offload memory.optimizer_offload: the float32 gradient shard to the host (Gh / PCIe), the
                     CPU Adam over the shard's state and gradient ((O + Gh) / CPU_ADAM_BYTES_PER_S), the
                     updated parameters back (Gh / 4 x e / PCIe); O, Gh: the plan's host optimizer and
                     optimizer_grads
    bubble(k)        (k + pp - 1) / k: 1F1B's fill and drain for k micro-batches through pp stages; with
                     parallel.vpp model chunks per rank (interleaved) (vpp k + pp - 1) / (vpp k)

total = their sum; per group = total / dp. Not modelled: TP / CP / EP collectives and data-parallel
reductions (so micro_step costs nothing here), fp8 dequantization (on the device, memory-bound), the
query blocks' recompute of GLM's sparse attention (memory.mla_query_block), the device optimizer step,
and host-memory bandwidth shared by a node's ranks beyond the per-rank constants.
"""

from __future__ import annotations

from longstraw_mcore.planner.activations import _elem
from longstraw_mcore.planner.efficiency import for_run
from longstraw_mcore.planner.memo import kept
from longstraw_mcore.replay.plan import even_micro_steps, interleaved_padding

PCIE_BYTES_PER_S = 25e9
"""Host <-> device per GPU, effective. H20 sits on PCIe Gen5 x16 (64 GB/s per direction nominal, ~50 GB/s
for one GPU's pinned copies alone); a node's 8 GPUs share two sockets' root complexes and DDR, so about
half of that each when all copy at once."""
CPU_ADAM_BYTES_PER_S = 10e9
"""Optimizer bytes (float32 master, moments, gradient copy) a CPU Adam update streams per second per
rank: a 2-socket DDR5 node's ~300-600 GB/s shared by 8 ranks' optimizer threads, with Adam's several
passes per element (read parameter, gradient and moments; write parameter and moments)."""

def _step(family, m, P: int, lengths: list[int], mode: str, chunk_len: int, tp: int, cp: int,
          batch_tokens: int) -> dict:
    """step_flops' algorithm count (capture and sweep summed over the cp ranks)."""
    from longstraw_mcore.planner.flops import step_flops

    return kept(("step", family.name, repr(m), P, tuple(lengths), mode, chunk_len, tp, cp, batch_tokens),
                 lambda: step_flops(family.layers, m, P, lengths, mode, chunk_len, tp, cp=cp,
                                    batch_tokens=batch_tokens)["algorithm"])


def _branches(family, m, P: int, lengths: list[int], exact: bool, tp: int, batch_tokens: int) -> tuple[float, float]:
    """(branch_flops, forward_flops) against P - 1 captured positions, micro-steps padded."""
    from longstraw_mcore.planner.flops import branch_flops, forward_flops

    return kept(("branches", family.name, repr(m), P, tuple(lengths), exact, tp, batch_tokens),
                 lambda: (branch_flops(family.layers, m, P, lengths, exact, tp, batch_tokens=batch_tokens),
                          forward_flops(family.layers, m, P, lengths, tp, batch_tokens)))


def bubble(k: int, pp: int, vpp: int = 1) -> float:
    """The pipeline's fill and drain: k micro-batches through pp stages take (k + pp - 1) / k of their work
    under 1F1B; with vpp model chunks per rank (Megatron's interleaved schedule) a chunk's forward or
    backward is 1/vpp of a stage's, so (vpp k + pp - 1) / (vpp k)."""
    return (vpp * k + pp - 1) / (vpp * k) if k > 0 else 1.0


def in_flight(cfg, P: int, R: int, G: int, stage: range) -> int:
    """Micro-batches the pipeline stage holding `stage` keeps for their backward at once: under 1F1B
    min(pp - s, passes + exact chunks); 1 without pipeline parallelism. Interleaved (parallel.vpp > 1),
    Megatron's warm-up of 2 (pp - s - 1) + (vpp - 1) pp chunk forwards and one more, each 1/vpp of the
    stage's layers (the micro-batches padded as replay/plan.py `interleaved_padding` pads them), in whole
    stages: ceil(chunks / vpp). (At vpp > 1 the planner counts a rank's layers as one contiguous range of
    its count, ParallelConfig.stage_layers: the same kinds where layer types repeat with the chunks.)"""
    p, rc = cfg.parallel, cfg.replay
    if p.pp == 1:
        return 1
    starts = [0]
    for n in p.stage_layers(cfg.model.num_layers)[:-1]:
        starts.append(starts[-1] + n)
    s = starts.index(stage.start)
    micro = even_micro_steps(R, G, rc.batch_tokens)[0] + (-(-(P - 1) // rc.chunk_len) if rc.mode == "exact" else 0)
    if p.vpp == 1:
        return min(p.pp - s, micro)
    total = p.vpp * (micro + interleaved_padding(micro, p.pp, p.vpp, False))
    return -(-min(2 * (p.pp - s - 1) + (p.vpp - 1) * p.pp + 1, total) // p.vpp)


def phase_flops(family, cfg, P: int, R: int, G: int, pieces=None) -> dict:
    """{phase: FLOPs per rank}: capture, replay, prompt_backward (exact mode) and, with
    memory.recompute=layer, recompute (the second forward); `pieces`: a prefix tree's (tokens, depth)
    (planner/tree.py) instead of G branches of R tokens; the replay's micro-steps under
    replay.batch_tokens, padded (planner/flops.py `padded_steps`: nothing added where the lengths are
    equal, as here)."""
    m, p, rc = cfg.model, cfg.parallel, cfg.replay
    exact = rc.mode == "exact"
    lengths = list(pieces) if pieces is not None else [R] * G
    full = _step(family, m, P, lengths, rc.mode, rc.chunk_len, p.tp, p.cp, rc.batch_tokens)
    replay, forward = _branches(family, m, -(-(P - 1) // p.cp) + 1, lengths, exact, p.tp, rc.batch_tokens)
    out = {"capture": full["capture"] / (p.pp * p.cp), "replay": replay / p.pp}
    if exact:
        out["prompt_backward"] = full["prompt_backward"] / (p.pp * p.cp)
    if cfg.memory.recompute == "layer":
        out["recompute"] = forward / p.pp + (out["capture"] if exact else 0.0)
    return out


def transfer_bytes(cfg, P: int, passes: int, host: dict) -> dict:
    """{phase: host <-> device bytes per rank} of memory.state_offload (the module docstring's terms)."""
    if not cfg.memory.state_offload:
        return {}
    n = -(-(P - 1) // cfg.replay.chunk_len)
    S, Sg = host["prompt_state"], host["prompt_state_grad"]
    out = {"capture": (n + 1) / 2 * S, "replay": passes * (2 * S + Sg)}
    if cfg.replay.mode == "exact":
        out["prompt_backward"] = (n - 1) * S + (n + 1) / 2 * Sg
    return out


def grad_transfer_bytes(cfg, P: int, passes: int, host: dict) -> float:
    """memory.grad_offload: host <-> device gradient bytes per rank and group step (the module docstring)."""
    if not cfg.memory.grad_offload:
        return 0.0
    micro = passes + (-(-(P - 1) // cfg.replay.chunk_len) if cfg.replay.mode == "exact" else 0)
    return 2.0 * host.get("gradients", 0) * micro


def optimizer_offload_seconds(cfg, host: dict) -> float:
    """memory.optimizer_offload: gradient shard down, CPU Adam, parameters up (the module docstring)."""
    if not cfg.memory.optimizer_offload:
        return 0.0
    O, Gh = host["optimizer"], host["optimizer_grads"]
    params = Gh / 4 * _elem(cfg.model.dtype)
    return (Gh + params) / PCIE_BYTES_PER_S + (O + Gh) / CPU_ADAM_BYTES_PER_S


def plan_time(family, cfg, P: int, R: int, G: int, world_size: int, dev, efficiency: float | None,
              host: dict, pieces=None, passes: int | None = None) -> dict:
    """{"flops": {phase: per rank}, "seconds": {term: s, ..., "total": s}, "seconds_per_group": s,
    "efficiency": {phase: its Figure as JSON}, "efficiency_measured_on": s, "efficiency_notes": [...]}
    of one group step (`dev`: a DeviceProfile; `efficiency`: None for the device table's per-phase
    figures, or one fraction for every phase; `host`: plan_host's components; `pieces` and `passes`: a
    prefix tree's pieces and replay micro-steps, planner/tree.py; by default the flat group's,
    replay/plan.py `even_micro_steps`)."""
    p = cfg.parallel
    eff = for_run(cfg, dev.name, efficiency)
    used = eff.phases()
    n = -(-(P - 1) // cfg.replay.chunk_len)
    if passes is None:
        if pieces is not None:
            raise ValueError("plan_time(pieces=...): also give the tree's passes (planner/tree.py tree_passes)")
        passes = even_micro_steps(R, G, cfg.replay.batch_tokens)[0]
    flops = phase_flops(family, cfg, P, R, G, pieces)
    peak = {k: dev.bf16_flops * used[k].value for k in flops}
    # two schedules per group step (replay/pipeline.py): the capture's n forwards, then the replay's passes
    # and, in exact mode, the sweep's n chunks in one schedule, sharing its fill and drain
    v, k = p.vpp, passes + (n if "prompt_backward" in flops else 0)
    seconds = {"capture": flops["capture"] / peak["capture"] * bubble(n, p.pp, v),
               "replay": flops["replay"] / peak["replay"] * bubble(k, p.pp, v)}
    if "prompt_backward" in flops:
        seconds["prompt_backward"] = flops["prompt_backward"] / peak["prompt_backward"] * bubble(k, p.pp, v)
    if "recompute" in flops:
        seconds["recompute"] = flops["recompute"] / peak["recompute"] * bubble(k, p.pp, v)
    if cfg.grpo.objective == "ppo":  # the critic's own capture, replay and sweep (memory.critic_terms): the
        # policy's phases again, an upper bound (its scalar head has no vocabulary projection)
        seconds["critic"] = sum(seconds.values())
    moved = transfer_bytes(cfg, P, passes, host)
    if moved:
        seconds["state_transfer"] = sum(moved.values()) / PCIE_BYTES_PER_S
    if cfg.memory.grad_offload:
        seconds["grad_transfer"] = grad_transfer_bytes(cfg, P, passes, host) / PCIE_BYTES_PER_S
    if cfg.memory.optimizer_offload:
        seconds["optimizer_offload"] = optimizer_offload_seconds(cfg, host)
    seconds["total"] = sum(seconds.values())
    idle = {"capture": 1 - 1 / bubble(n, p.pp, v), "replay": 1 - 1 / bubble(k, p.pp, v)}
    return {"flops": flops, "seconds": seconds, "seconds_per_group": seconds["total"] / p.dp_for(world_size),
            "bubble": dict(schedule="none" if p.pp == 1 else "1F1B" if v == 1 else f"interleaved, vpp={v}",
                           micro_batches={"capture": n, "replay": k}, idle_fraction=idle),
            "transfer_bytes": moved, "efficiency": {k: used[k].as_json() for k in flops},
            "efficiency_measured_on": eff.measured_on, "efficiency_notes": list(eff.notes)}
