"""Per-rank memory of a branch-replay step, by component, from the config alone (no Megatron, no torch
allocation): what `longstraw plan` prints and `train` / `validate` check before they allocate. What
differs by family comes from the family record the caller hands in (`family`: its checkpoint table's
tensor shapes, its per-layer-type records: prompt_state/kinds.py).

Legend: P prompt tokens (P - 1 captured), R response tokens of the longest branch, G branches, tp / pp /
cp / ep / dp the layout, e the model dtype's bytes. Per rank (the largest pipeline stage and TP rank):

    weights          this rank's parameters x e. Every checkpoint tensor of the family's mapping table
                     (its Hugging Face shape): matrices split over tp (experts over ep), vectors
                     replicated; the embedding on the first stage, the output layer on the last
    gradients        train.grad_reduction=step: Megatron DDP's buffer, one value per parameter (float32
                     below float32 models: grad_reduce_in_fp32); micro_step: the float32 shards,
                     1/(dp cp) of it, plus one micro-step's gradients in the model dtype before they are
                     reduce-scattered
    optimizer        Adam's two moments in float32, and a float32 master copy below float32 models;
                     sharded over dp x cp with the distributed optimizer or micro_step
    (adapters)       with adapter.rank > 0 the three above count the adapter parameters only
                     (planner/adapters.py), and the weights add the frozen base, its projections at
                     adapter.base_dtype (NF4 0.516, FP8 1.031 bytes per weight)
    prompt_state     the state kinds' own formulas (prompt_state/*.py analytic_bytes) for the stage's
                     layers, at this rank's share of the positions (1/cp; GLM's latent also 1/tp)
    prompt_state_grad exact mode: the state gradient accumulators (analytic_grad_bytes)
    activations      the worst phase of the step (phase_bytes): a branch's saved tensors through the
                     stage's layers (planner/activations.py, derived from the code op by op) plus the
                     log-prob chunk's logits and the output layer's weight gradient; or, in exact
                     mode, one capture chunk's saved tensors in the prompt backward
    comm_buffers     CUDA: NCCL's communicator buffers (an estimate, 256 MiB per rank); gloo: none
                     (Megatron DDP's buckets are views into the gradient buffer, counted above)
    allocator_slack  CUDA: 5% of everything else (the caching allocator's fragmentation); CPU: none
                     (tensors are freed to the system allocator)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from longstraw_mcore.config import ConfigError
from longstraw_mcore.planner.activations import _elem

SLACK = 0.05
NCCL_BYTES = 256 * 2**20


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    bf16_flops: float
    """Dense bf16 peak, FLOP/s."""


DEVICE_PROFILES = {
    "H20-96GB": DeviceProfile("H20-96GB", 96 * 10**9, 148e12),
    "H100-80GB": DeviceProfile("H100-80GB", 80 * 10**9, 989e12),
    "H200-141GB": DeviceProfile("H200-141GB", 141 * 10**9, 989e12),
}


def device_profile(name: str, memory_gib: float | None = None) -> DeviceProfile:
    if name not in DEVICE_PROFILES:
        raise ConfigError(f"--device {name!r}: not a known device profile; known: {sorted(DEVICE_PROFILES)}")
    d = DEVICE_PROFILES[name]
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--device-gib {memory_gib}: must be > 0")
        d = DeviceProfile(d.name, int(memory_gib * 2**30), d.bf16_flops)
    return d


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def rank_params(family, m, tp: int, ep: int, stage_layers: list[int], stage: int) -> int:
    """Parameters on one rank of pipeline stage `stage` (the checkpoint's tensors, split as the model
    splits them; the vocabulary padded as the model pads it)."""
    first = sum(stage_layers[:stage])
    mine = range(first, first + stage_layers[stage])
    n = 0
    for name, shape in family.checkpoint.hf_shapes(m).items():
        layer = _layer_of(name)
        if layer is None:
            if name.startswith("model.embed_tokens") and stage != 0:
                continue
            if (name.startswith("lm_head") or name == "model.norm.weight") and stage != len(stage_layers) - 1:
                continue
            if name.startswith(("model.embed_tokens", "lm_head")):
                n += m.padded_vocab_size(tp) * shape[1] // tp
                continue
        elif layer not in mine:
            continue
        size = math.prod(shape)
        if ".mlp.experts." in name:
            n += size // ep  # experts whole on their EP rank
        elif len(shape) == 1 or ".gate.weight" in name or "indexer." in name:
            n += size        # vectors, the router and the indexer are replicated over TP
        else:
            n += size // tp
    return n


def phase_bytes(family, cfg, P: int, R: int, G: int, stage: range, last_stage: bool) -> dict:
    """{phase: bytes} that one rank of the stage holding global layers `stage` allocates on top of the
    parameters, gradients, optimizer and prompt state during each phase (its worst moment):

      capture          one layer's intermediates for a chunk (no autograd: they are freed layer by layer);
                       with DSA the indexer's block of scores on top (a layer kind's scratch)
      replay           every layer's saved tensors for R tokens (G x R with replay.batch_branches),
                       plus the larger of one layer's backward (gradients the size of its saved
                       tensors) and, on the last stage, the log-prob chunk's worst moment: while it is
                       recomputed the logits (model dtype), their float32 copy, the shifted values and
                       their exp; in the output layer's backward the logits' gradient and the weight
                       gradient before it is added to .grad / main_grad; exact mode adds one layer's
                       state gradient before it is accumulated
      prompt_backward  exact mode: every layer's saved tensors for one capture chunk (the last layer
                       only as far as its state) and one layer's state gradient (measured on H200 and
                       CPU: the chunk's backward needs no more than its forward kept)
    Token counts are this rank's: a chunk's 1/cp under context parallelism, branches whole."""
    from longstraw_mcore.planner.activations import layer_bytes
    from longstraw_mcore.prompt_state.containers import analytic_state_grad_bytes

    m, p, rc, layers = cfg.model, cfg.parallel, cfg.replay, family.layers
    e, w = _elem(m.dtype), max(4, _elem(m.dtype))
    chunk = -(-min(rc.chunk_len, max(P - 1, 1)) // p.cp)
    captured = -(-(P - 1) // p.cp)
    exact = rc.mode == "exact"
    types = sorted({m.layer_types[i] for i in stage})
    one_grad = max(analytic_state_grad_bytes(layers, m, p.tp, captured, [t]) for t in types) if exact else 0
    last = stage[-1] if last_stage else None

    def rows(i):  # the prompt positions layer i reads on this rank (MLA latents: striped over TP too)
        return layers[m.layer_types[i]].state.rows(captured, p.tp)

    def scratch(T):  # no-autograd scratch while a layer runs (MLA + DSA: the indexer's block of scores)
        return max(layers[t].scratch_bytes(m, T, layers[t].state.rows(captured, p.tp)) for t in types)

    def saved(T, own, recompute=False):
        return sum(layer_bytes(layers, m, p.tp, T, i, rows(i) + own, produce_only=recompute and i == last)
                   for i in stage)

    def widest(T, own):  # a layer's backward: its saved tensors are alive and gradients of their size made
        return max(layer_bytes(layers, m, p.tp, T, i, rows(i) + own) for i in stage)

    out = {"capture": widest(chunk, 0) + scratch(chunk)}
    T = R * (G if rc.batch_branches else 1)
    top = widest(T, T)
    if last_stage:
        c = min(rc.logprob_chunk, R) * (G if rc.batch_branches else 1)
        vocab = m.padded_vocab_size(p.tp) // p.tp
        # recompute: logits, their work-dtype copy (none when the model is already in it), the shifted
        # values and their exp; backward: the logits' gradient and the output layer's weight gradient
        copies = e + (0 if e == w else w) + 2 * w
        # (no output-layer weight gradient when it is frozen: adapters that leave lm_head out)
        frozen = cfg.adapter.enabled and "lm_head" not in cfg.adapter.resolved_targets(m.projection_shapes())
        top = max(top, c * vocab * copies, c * vocab * e + (0 if frozen else vocab * m.hidden_size * e))
        top += T * layers[m.layer_types[-1]].norm_bytes(m.hidden_size, e)  # the final norm: the layers' kind
    if cfg.adapter.enabled and cfg.adapter.base_dtype in ("nf4", "fp8"):
        # a quantized projection's weight, dequantized for its product (forward and backward)
        from longstraw_mcore.planner.adapters import largest_projection, sites_of

        deq = largest_projection(sites_of(family, m), p.tp, p.ep, stage) * e
        top += deq
        out["capture"] += deq
    out["replay"] = saved(T, T) + top + one_grad
    out["prompt_backward"] = saved(chunk, 0, recompute=True) + one_grad if exact else 0
    return out


def plan_memory(family, cfg, P: int, R: int, G: int, world_size: int, cuda: bool | None = None,
                grads: str = "train") -> dict:
    """{component: bytes} for the largest rank of the run `cfg` (a RunConfig) on `world_size` ranks at
    prompt P, response R, group size G (`cuda`: on GPUs; default: the config's device); bad input
    raises ConfigError before anything is computed. `grads="plain"`: gradients as plain `.grad`
    tensors in the model dtype (a model without DDP, as tools/bench_replay.py runs it)."""
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes, analytic_state_grad_bytes

    for name, v in (("prompt length", P), ("response length", R), ("group size", G)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} {v!r}: must be a positive integer")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = p.dp_for(world_size)
    stages = p.stage_layers(m.num_layers)
    e = _elem(m.dtype)
    captured = -(-(P - 1) // p.cp)
    chunks = -(-(P - 1) // cfg.replay.chunk_len)
    exact = cfg.replay.mode == "exact"
    shards = dp * p.cp
    on_cuda = cfg.resolved_device() == "cuda" if cuda is None else cuda
    best = None
    for s in range(p.pp):
        first = sum(stages[:s])
        layers = range(first, first + stages[s])
        types = [m.layer_types[i] for i in layers]
        n = rank_params(family, m, p.tp, p.ep, stages, s)
        out = {"weights": n * e}
        if cfg.adapter.enabled:  # only the adapters train; the base's projections at adapter.base_dtype
            from longstraw_mcore.planner.adapters import BASE_BYTES, adapter_params, projection_params, sites_of

            sites = sites_of(family, m)
            proj = projection_params(sites, p.tp, p.ep, layers)
            kind = cfg.adapter.base_dtype
            base = (n - proj) * e + int(proj * (BASE_BYTES[kind] if kind in BASE_BYTES else e))
            n = adapter_params(sites, cfg, p.tp, p.ep, layers, s == p.pp - 1)
            out["weights"] = base + n * e
        if grads == "plain":
            out["gradients"] = n * e
        elif t.grad_reduction == "micro_step":
            out["gradients"] = -(-n * 4 // shards) + n * e
        else:
            out["gradients"] = n * (4 if m.dtype == "bfloat16" else e)
        moments = n * 8 + (n * 4 if m.dtype == "bfloat16" else 0)
        out["optimizer"] = -(-moments // shards) if (t.distributed_optimizer or t.grad_reduction == "micro_step") \
            else moments
        out["prompt_state"] = sum(analytic_state_bytes(family.layers, m, p.tp, captured, chunks if exact else 0, 1,
                                                       types, p.cp).values())
        out["prompt_state_grad"] = analytic_state_grad_bytes(family.layers, m, p.tp, captured, types) if exact else 0
        out["activations"] = max(phase_bytes(family, cfg, P, R, G, layers, s == p.pp - 1).values())
        out["comm_buffers"] = NCCL_BYTES if on_cuda else 0
        out["allocator_slack"] = int(SLACK * sum(out.values())) if on_cuda else 0
        if best is None or sum(out.values()) > sum(best.values()):
            best = out
    return best


STEP_COMPONENTS = ("gradients", "prompt_state", "prompt_state_grad", "activations")


def step_peak_bytes(family, cfg, P: int, R: int, G: int, world_size: int, cuda: bool) -> int:
    """What a measured step peak above the parameters counts (tools/bench_replay.py, the H200 data,
    tools/plan_vs_measured.py): plain `.grad` tensors allocated in the step, the prompt state and its
    gradient, the worst phase's activations, and (CUDA) the allocator slack on those."""
    per = plan_memory(family, cfg, P, R, G, world_size, cuda=False, grads="plain")
    return int(sum(per[k] for k in STEP_COMPONENTS) * (1 + (SLACK if cuda else 0)))


def max_prompt_len(family, cfg, R: int, G: int, world_size: int, device_bytes: int, cuda: bool | None = None,
                   limit: int = 1 << 34) -> int:
    """The largest P whose plan fits `device_bytes` per rank (0 if none does)."""
    def fits(P):
        return sum(plan_memory(family, cfg, P, R, G, world_size, cuda).values()) <= device_bytes

    if not fits(2):
        return 0
    lo, hi = 2, 4
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
