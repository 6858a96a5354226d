"""Per-rank memory of a branch-replay step, by component, from the config alone (no Megatron, no torch
allocation): what `longstraw plan` prints and `train` / `validate` check before they allocate.

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
    prompt_state     the state kinds' own formulas (prompt_state/*.py analytic_bytes) for the stage's
                     layers, at this rank's share of the positions (1/cp; GLM's latent also 1/tp)
    prompt_state_grad exact mode: the state gradient accumulators (analytic_grad_bytes)
    branch_activations one branch's tensors kept for its backward, R tokens through the stage's layers
                     (an estimate: the inputs every linear, norm and attention kernel keeps)
    logprob_chunk    float32 logits, softmax and their gradient for replay.logprob_chunk tokens x V/tp
    comm_buffers     CUDA: NCCL's communicator buffers (an estimate, 256 MiB per rank); gloo: none
                     (Megatron DDP's buckets are views into the gradient buffer, counted above)
    allocator_slack  5% of everything else (caching-allocator fragmentation)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from longstraw_mcore.config import ConfigError

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


def _elem(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def rank_params(m, tp: int, ep: int, stage_layers: list[int], stage: int) -> int:
    """Parameters on one rank of pipeline stage `stage` (the checkpoint's tensors, split as the model
    splits them; the vocabulary padded as the model pads it)."""
    from longstraw_mcore.families import get_family

    first = sum(stage_layers[:stage])
    mine = range(first, first + stage_layers[stage])
    n = 0
    for name, shape in get_family(m.family).mapping.hf_shapes(m).items():
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


def activation_bytes(m, tp: int, R: int, layers: range) -> int:
    """One branch of R tokens with autograd through these (global) layers: values kept for the backward,
    per token (the inputs of every linear and norm, the attention's q/k/v/out, the MLP's fc1 output and
    activation), in the model dtype."""
    H = m.hidden_size
    mlp_types = getattr(m, "mlp_types", None)
    per = 0
    for i in layers:
        t = m.layer_types[i]
        v = 4 * H  # two norms' inputs and outputs
        if t == "full_attention":
            v += (3 * m.num_attention_heads + 2 * max(m.num_key_value_heads, tp)) * m.head_dim // tp
        elif t == "linear_attention":
            kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
            v += (3 * (2 * kd + vd) + 3 * vd) // tp
        else:  # MLA + DSA: q LoRA, the latent, per head q (no-RoPE, RoPE), latent-space and value outputs
            v += m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
            v += m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
                                          + m.kv_lora_rank) // tp
        if mlp_types is not None and mlp_types[i] == "moe":  # routed top-k + shared experts, per token
            F = m.moe_intermediate_size * (m.num_experts_per_tok + m.n_shared_experts)
        else:
            F = m.intermediate_size // tp
        per += v + 3 * F
    return per * R * _elem(m.dtype)


def plan_memory(cfg, P: int, R: int, G: int, world_size: int, cuda: bool | None = None) -> dict:
    """{component: bytes} for the largest rank of the run `cfg` (a RunConfig) on `world_size` ranks at
    prompt P, response R, group size G (`cuda`: on GPUs; default: the config's device); bad input
    raises ConfigError before anything is computed."""
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
        n = rank_params(m, p.tp, p.ep, stages, s)
        out = {"weights": n * e}
        if t.grad_reduction == "micro_step":
            out["gradients"] = -(-n * 4 // shards) + n * e
        else:
            out["gradients"] = n * (4 if m.dtype == "bfloat16" else e)
        moments = n * 8 + (n * 4 if m.dtype == "bfloat16" else 0)
        out["optimizer"] = -(-moments // shards) if (t.distributed_optimizer or t.grad_reduction == "micro_step") \
            else moments
        out["prompt_state"] = sum(analytic_state_bytes(m, p.tp, captured, chunks if exact else 0, 1, types,
                                                       p.cp).values())
        out["prompt_state_grad"] = analytic_state_grad_bytes(m, p.tp, captured, types) if exact else 0
        out["branch_activations"] = activation_bytes(m, p.tp, R, layers) * (G if cfg.replay.batch_branches else 1)
        vocab = m.padded_vocab_size(p.tp) // p.tp
        out["logprob_chunk"] = 3 * min(cfg.replay.logprob_chunk, R) * vocab * 4 if s == p.pp - 1 else 0
        out["comm_buffers"] = NCCL_BYTES if on_cuda else 0
        out["allocator_slack"] = int(SLACK * sum(out.values()))
        if best is None or sum(out.values()) > sum(best.values()):
            best = out
    return best


def max_prompt_len(cfg, R: int, G: int, world_size: int, device_bytes: int, cuda: bool | None = None,
                   limit: int = 1 << 34) -> int:
    """The largest P whose plan fits `device_bytes` per rank (0 if none does)."""
    def fits(P):
        return sum(plan_memory(cfg, P, R, G, world_size, cuda).values()) <= device_bytes

    if not fits(2):
        return 0
    lo, hi = 2, 4
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
