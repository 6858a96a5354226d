"""Per-rank memory of a branch-replay step, by component, from the config alone (no Megatron, no torch
allocation): what `longstraw plan` prints and `train` / `validate` check before they allocate. What
differs by family comes from the family record the caller hands in (`family`: its checkpoint table's
tensor shapes, its per-layer-type records: prompt_state/kinds.py). Two sides: `plan_memory` gives a
rank's device bytes, `plan_host` its host bytes (what the `memory` section's switches put in host
memory: config/memory.py); `plan_both` both.

Legend: P prompt tokens (P - 1 captured), R response tokens of the longest branch, G branches, tp / pp /
cp / ep / dp the layout, e the model dtype's bytes, n this rank's trainable parameters, shards = dp x cp
(the distributed optimizer and micro_step shard over them). Device, per rank (the largest pipeline
stage and TP rank):

    weights          this rank's parameters x e. Every checkpoint tensor of the family's mapping table
                     (its Hugging Face shape): matrices split over tp (experts over ep), vectors
                     replicated; the embedding on the first stage, the output layer on the last
    gradients        train.grad_reduction=step: Megatron DDP's buffer, one value per parameter (float32
                     below float32 models: grad_reduce_in_fp32); micro_step: the float32 shards,
                     1/(dp cp) of it, one bucket's send buffer and reduce-scatter output, and what one
                     micro-step's gradient in the model dtype adds to the activations' peak
                     (micro_step_gradients; unchanged by memory.optimizer_offload); with
                     memory.grad_offload the buckets alone
    optimizer        Adam's two moments in float32, and a float32 master copy below float32 models;
                     sharded over dp x cp with the distributed optimizer or micro_step; 0 on the device
                     with memory.optimizer_offload (then on the host, below)
    (adapters)       with adapter.rank > 0 the three above count the adapter parameters only
                     (planner/adapters.py), and the weights add the frozen base, its projections at
                     adapter.base_dtype (NF4 0.516, FP8 1.031 bytes per weight): no base gradient
    prompt_state     the state kinds' own formulas (prompt_state/*.py analytic_bytes) for the stage's
                     layers, at this rank's share of the positions (1/cp; GLM's latent also 1/tp).
                     memory.state_dtype=fp8: the position-sized categories (attention K/V, MLA latents)
                     as fp8 blocks, fp8_nbytes(rows, v) per tensor; memory.state_offload: those
                     categories on the host instead (planner/state.py); Gated DeltaNet's state stays
    prompt_state_grad exact mode: the state gradient accumulators (analytic_grad_bytes); with
                     memory.state_offload the position-sized kinds' on the host (GDN's stay)
    activations      the worst phase of the step (phase_bytes, planner/activations.py: derived from
                     the code op by op): a replay micro-step's saved tensors through the stage's layers
                     plus the log-prob chunk's logits and the output layer's weight gradient; or (exact)
                     one capture chunk's saved tensors in the prompt backward; or the capture's worst
                     layer moment, per attention kernel. With plain `.grad` tensors (grads="plain", as
                     tools/bench_replay.py runs) the gradients and state gradients do not exist yet
                     while the prompt is captured: the capture is set against the other phases without
                     them. memory.recompute=layer, state staging, memory.mla_query_block: phase_bytes
    comm_buffers     CUDA: NCCL's communicator buffers (an estimate, 256 MiB per rank); gloo: none
                     (Megatron DDP's buckets are views into the gradient buffer, counted above)
    allocator_slack  CUDA: 5% of everything else (the caching allocator's fragmentation); CPU: none
                     (tensors are freed to the system allocator)
    critic_*         grpo.objective=ppo: the critic's weights, gradient buffer and Adam state beside the
                     policy's (critic_terms: same ranks, time-shared; its state and activations are the
                     policy's at most and gone before the policy's pass)

Host, per rank (pinned on CUDA; a node holds min(ranks, gpus per node) ranks, each counted as the
largest; not counted: the process itself, the CUDA context, data loading, checkpoint I/O):

    gradients        memory.grad_offload (micro_step): one micro-step's gradients in the model dtype
                     (n x e, staged as autograd completes them)
    gradient_shards  memory.grad_offload: the float32 shards they are reduce-scattered into (n x 4 / shards)
    optimizer        memory.optimizer_offload: the optimizer term above (moments + float32 master copy)
    optimizer_grads  memory.optimizer_offload: a float32 copy of this rank's gradient shard for the CPU
                     update, n x 4 / shards (offload runs sharded: micro_step, or the distributed optimizer)
    prompt_state     memory.state_offload: the position-sized categories (model dtype, or fp8 blocks)
    prompt_state_grad memory.state_offload, exact mode: the position-sized kinds' gradients (float32)
"""

from __future__ import annotations

from longstraw_mcore.config import ConfigError
from longstraw_mcore.planner.activations import _elem
from longstraw_mcore.planner.memo import kept
from longstraw_mcore.planner.timing import in_flight
from longstraw_mcore.planner.weights import largest_trainable, stage_weights
from longstraw_mcore.replay.plan import even_micro_steps

SLACK = 0.05
NCCL_BYTES = 256 * 2**20
HOST_GIB = 2048
"""Default host memory per node (`longstraw plan --host-gib`): an 8-GPU H20 server's DDR (2 TiB:
LongStraw's nodes)."""
GPUS_PER_NODE = 8
"""Default ranks per node (`--gpus-per-node`)."""


def node_ranks(world_size: int, gpus_per_node: int) -> int:
    """Ranks on one node: a run smaller than a node fills only part of it."""
    if not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node!r}: must be a positive integer")
    return min(world_size, gpus_per_node)


def micro_step_gradients(family, cfg, stages: list[int], s: int, n: int, shards: int, later: int,
                         plain: bool = False) -> tuple[int, dict]:
    """(device bytes, {host component: bytes}) of train.grad_reduction=micro_step's gradients on one rank
    (train/zero2.py), `later` being the largest activations of the phases after the capture:
    - the shards (float32; float64 models' float64): n x r / shards;
    - the reduction's buffers, made at the first round and kept: one bucket's send buffer and its
      reduce-scatter output (a bucket closes at the parameter that reaches train.grad_bucket_mib, so
      it holds at most that plus the largest parameter). Gloo's reduce-scatter also copies the send
      buffer while it runs, after the backward, when the activations are gone: not added;
    - one micro-step's full gradient in the model dtype, n x e. Autograd makes it while the backward
      frees that micro-step's activations, and it is reduced (freed) before the next micro-step, so
      it adds to the peak only by what it exceeds the activations by (the planner's `activations`
      term holds the output layer's weight gradient beside the logits, the largest single one).
    With memory.grad_offload that gradient and the shards are in host memory; a gradient reaches the
    host as soon as autograd completes it. With the optimizer on the device, its update reads the
    shards there (ShardedAdam.step), when the buckets are idle and the activations gone.
    `plain`: what a step allocates beside what exists before it (the shards), the update left out."""
    m = cfg.model
    e, r = _elem(m.dtype), 8 if m.dtype == "float64" else 4
    shard = -(-n * r // shards)
    bucket = min(n * r, int(cfg.train.grad_bucket_mib * 2**20) + largest_trainable(family, cfg, stages, s) * r)
    reduce = bucket + (-(-bucket // shards) if shards > 1 else 0)
    if not cfg.memory.grad_offload:
        return (0 if plain else shard) + reduce + max(0, n * e - later), {}
    update = 0 if plain or cfg.memory.optimizer_offload else shard
    return max(reduce, update), {"gradients": n * e, "gradient_shards": shard}


def phase_bytes(family, cfg, P: int, R: int, G: int, stage: range, last_stage: bool, kernels: str = "cuda") -> dict:
    """{phase: bytes} that one rank of the stage holding global layers `stage` allocates on top of the
    parameters, gradients, optimizer and prompt state during each phase (its worst moment):

      capture          one layer's worst moment for a chunk (no autograd): the kind's capture_bytes,
                       counted per attention kernel (Qwen's), else its intermediates (an upper bound)
                       or, where larger, its scores' moment (scratch_bytes: the DSA indexer's)
      replay           every layer's saved tensors for a micro-step's T tokens (replay.batch_tokens),
                       plus the larger of one layer's backward (the twins: its saved tensors' worth,
                       score blocks and gathered latents included; flash and the DSA kernels: the
                       kinds' backward_scratch) and, on the last
                       stage, the log-prob chunk's worst moment: while it is recomputed the logits,
                       their float32 copy, the shifted values and their exp; in the output layer's
                       backward the logits' gradient and the weight gradient; exact mode adds one
                       layer's state gradient before it is accumulated; or, where larger, the forward
                       at a layer's scores (the DSA indexer's score blocks, scratch_bytes, beside the
                       earlier layers' saved tensors). memory.recompute=layer: every layer's input
                       [T, hidden] x e instead of its saved tensors, and a layer's backward holds its
                       recomputed saved tensors and its backward_scratch (the gradients it makes take
                       the place of the saved tensors they consume), or its scores again beside its
                       output's gradient
      prompt_backward  exact mode: every layer's saved tensors for one capture chunk (the last layer
                       only as far as its state) and one layer's state gradient, or where larger the
                       chunk's recompute at a layer's scores (as in the replay: at a 199-token chunk
                       of the tiny GLM, 4 layers, the third layer's indexer beside the first two
                       layers' saved tensors is the step's peak); with
                       replay.keep_prompt_graph_mib the kept capture chunks' saved tensors join the
                       capture and the replay, and the sweep holds them at its start (measured on H200 and
                       CPU: the chunk's backward needs no more than its forward kept).
                       memory.recompute=layer: every layer's chunk input [chunk, hidden] x e and one
                       layer run again with autograd: the larger of its forward's scores moment (the
                       kind's scratch_bytes, as in capture: the DSA indexer runs again, beside the
                       gradient of the layer's output) and its backward's (recomputed saved tensors
                       and backward_scratch)
    Under pipeline parallelism the replay and the sweep run as one 1F1B schedule whose micro-batches
    are the replay micro-steps (replay/plan.py) and, in exact mode, the chunks: stage s holds
    min(pp - s, micro-batches) of them in flight (replay/pipeline.py; planner/timing.py `in_flight`), so
    what each keeps for its backward (its saved tensors, or with recompute its layers' inputs) counts that
    many times.
    Every phase adds, with state staging (memory.state_offload or state_dtype=fp8), the largest layer's
    position-sized state in the model dtype (planner/state.py staging_bytes); memory.mla_query_block
    shrinks GLM's per-query top-k terms (planner/activations.py mla_bytes).
    Token counts are this rank's: a chunk's 1/cp under context parallelism, branches whole.
    Every torch.utils.checkpoint call (memory.recompute=layer's, one per layer; the twin's MLA query
    blocks) keeps the CPU RNG state with its graph: RNG_STATE_BYTES each, device bytes on CPU only.
    `kernels` ("cpu" / "cuda"): where they run; ops.attention's kernel there (ops/kernel_choice.py) sets
    the attention terms, and a kind that names its own (LayerKind.kernel_name: GLM's ops.dsa,
    dsa_kernel_name) its terms: the DSA kernels' (no per-head score blocks, no gathered latents) or the twins'."""
    from longstraw_mcore.ops.kernel_choice import attention_kernel_name
    from longstraw_mcore.parallel.cp import gdn_path
    from longstraw_mcore.planner.adapters import frozen_base_activation_delta  # (0 without adapters)
    from longstraw_mcore.planner.activations import RNG_STATE_BYTES, kind_bytes
    from longstraw_mcore.planner.state import staging_bytes
    from longstraw_mcore.prompt_state.containers import analytic_state_grad_bytes

    m, p, rc, mem, layers = cfg.model, cfg.parallel, cfg.replay, cfg.memory, family.layers
    e, w = _elem(m.dtype), max(4, _elem(m.dtype))
    chunk = -(-min(rc.chunk_len, max(P - 1, 1)) // p.cp)
    captured = -(-(P - 1) // p.cp)
    exact = rc.mode == "exact"
    recompute = mem.recompute == "layer"
    qb = mem.mla_query_block
    lt = m.layer_types  # (a property that builds the list)
    types = sorted({lt[i] for i in stage})
    one_grad = max(analytic_state_grad_bytes(layers, m, p.tp, captured, [t]) for t in types) if exact else 0
    last = stage[-1] if last_stage else None
    wide = gdn_path(m, p.tp, p.cp) == "sequence"  # a chunk's GDN rule on values Dk wider (parallel/cp_gdn.py)
    attention = attention_kernel_name(cfg.ops.attention, kernels, m.dtype, getattr(m, "head_dim", 0), planner=True)
    rng = RNG_STATE_BYTES if kernels == "cpu" else 0  # what each torch.utils.checkpoint call keeps on the device

    def kern(i):  # the kernel layer i's mixer runs: its kind's own (GLM's ops.dsa) or ops.attention's
        kind = layers[lt[i]]
        return kind.kernel_name(cfg.ops, kernels, m.dtype) if kind.kernel_name is not None else attention

    def rows(i):  # the prompt positions layer i reads on this rank (MLA latents: striped over TP too)
        return layers[lt[i]].state.rows(captured, p.tp)

    def scratch(T, i):  # layer i's capture moment: counted (capture_bytes) or its scores' (the indexer's)
        return layers[lt[i]].capture_moment(m, T, rows(i), p.tp, kern(i))

    def scores(T, keys, i):  # layer i's scores moment (the DSA indexer's; 0 for kinds without one)
        return layers[lt[i]].scratch_bytes(m, T, keys, p.tp, kern(i))

    def backward_scratch(T, i, keys):  # what layer i's backward makes beside its saved tensors (score blocks)
        return layers[lt[i]].backward_scratch(m, T, keys, p.tp, kern(i))

    def replay_keys(T, i):  # the keys layer i's replay backward makes gradients for: the DSA kernels read the
        # state and the branch's rows as two parts and give only those that take a gradient one (the
        # branch's; exact mode's state leaves too: ops/dsa_triton_mla.py); the others every visible key
        if layers[lt[i]].kernel_name is not None and kern(i) != "plain":
            return T + (rows(i) if exact else 0)
        return max(rows(i), T)

    def checkpoints(T, i):  # layer i's own torch.utils.checkpoint calls under autograd (MLA query blocks)
        return layers[lt[i]].checkpoints(m, T, qb, kern(i))

    def one(T, own, i, produce_only=False):  # own = 0: a prompt chunk (its own keys are the state's); own = T: branches
        return kind_bytes(layers[lt[i]], m, p.tp, T, i, rows(i) + own, produce_only=produce_only, query_block=qb,
                          gdn_wide=wide and own == 0, kernel=kern(i)) + frozen_base_activation_delta(
            family, m, cfg.adapter, p.tp, T, i, produce_only) + (0 if produce_only else rng * checkpoints(T, i))

    def saved(T, own, sweep=False):  # sweep: the model's last layer runs only as far as its state
        return sum(one(T, own, i, produce_only=sweep and i == last) for i in stage)

    def forward(T, own, sweep=False):  # a pass at a layer's scores: the earlier layers' saved tensors beside them
        best = prefix = 0
        for i in stage:
            if not (sweep and i == last):
                best = max(best, prefix + scores(T, rows(i) + own, i))
            prefix += one(T, own, i, produce_only=sweep and i == last)
        return best

    def inputs(T, sweep=False):  # memory.recompute=layer: what each layer keeps for its backward: its input,
        # its checkpoint's RNG state and its own checkpoints' (kept with the graph)
        return sum(T * m.hidden_size * e + rng * (1 + (0 if sweep and i == last else checkpoints(T, i)))
                   for i in stage)

    def capture(i):  # layer i's capture of a chunk: its counted moment, or its intermediates (an upper bound)
        counted = layers[lt[i]].capture_bytes is not None and not wide  # (or its scores' moment)
        return scratch(chunk, i) if counted else max(one(chunk, 0, i), scratch(chunk, i))

    out = {"capture": max(capture(i) for i in stage)}
    T = R * even_micro_steps(R, G, rc.batch_tokens)[1]  # the widest micro-step: its branches x R
    if recompute:  # one layer's backward: its recomputed saved tensors and its backward's scratch, or its
        # forward run again at its scores, beside the gradient of its output
        top = max(max(one(T, T, i) + backward_scratch(T, i, replay_keys(T, i)),
                      scores(T, rows(i) + T, i) + T * m.hidden_size * e) for i in stage)
    else:  # one layer's backward, what it makes beside its saved tensors: a kernel's backward_scratch (flash,
        # the DSA kernels); the twins' (score blocks, gathered latents) as one layer's saved tensors' worth
        top = max(backward_scratch(T, i, replay_keys(T, i)) if kern(i) != "plain" else one(T, T, i) for i in stage)
    if last_stage:
        c = min(rc.logprob_chunk, R) * (T // R)
        vocab = m.padded_vocab_size(p.tp) // p.tp
        # recompute: logits, their work-dtype copy (none when the model is already in it), the shifted
        # values and their exp; backward: the logits' gradient and the output layer's weight gradient
        copies = e + (0 if e == w else w) + 2 * w
        # (no output-layer weight gradient when it is frozen: adapters that leave lm_head out)
        frozen = cfg.adapter.enabled and "lm_head" not in cfg.adapter.resolved_targets(m.projection_shapes())
        top = max(top, c * vocab * copies, c * vocab * e + (0 if frozen else vocab * m.hidden_size * e))
        top += T * layers[lt[-1]].norm_bytes(m.hidden_size, e)  # the final norm: the layers' kind
    if cfg.adapter.enabled and cfg.adapter.base_dtype in ("nf4", "fp8"):
        # a quantized projection's weight, dequantized for its product (forward and backward)
        from longstraw_mcore.planner.adapters import largest_projection, sites_of

        deq = kept(("deq", family.name, repr(m), p.tp, p.ep, stage.start, stage.stop),
                   lambda: largest_projection(sites_of(family, m), p.tp, p.ep, stage)) * e
        top += deq
        out["capture"] += deq
    flight = in_flight(cfg, P, R, G, stage)
    if recompute:
        out["replay"] = flight * inputs(T) + top + one_grad
    else:  # its backward, or its forward at a layer's scores (the indexer's, beside the earlier layers')
        mine = saved(T, T)
        out["replay"] = max(flight * mine + top + one_grad, (flight - 1) * mine + forward(T, T))
    if not exact:
        out["prompt_backward"] = 0
    elif recompute:  # one layer at a time, run again with autograd: the larger of its forward's scores
        def sweep_layer(i):  # moment (beside its output's gradient) and its backward's (recomputed saved
            own = one(chunk, 0, i, produce_only=i == last)  # tensors and the score blocks)
            again = 0 if i == last else scores(chunk, rows(i), i) + chunk * m.hidden_size * e
            return max(scratch(chunk, i), again, own + backward_scratch(chunk, i, rows(i)))

        out["prompt_backward"] = flight * inputs(chunk, sweep=True) + max(sweep_layer(i) for i in stage) + one_grad
    else:  # the chunk's backward, or its recompute's forward at a layer's scores
        mine = saved(chunk, 0, sweep=True)
        out["prompt_backward"] = max(flight * mine + one_grad, (flight - 1) * mine + forward(chunk, 0, sweep=True))
    from longstraw_mcore.planner.activations import kept_graph_bytes

    kept_graphs = kept_graph_bytes(cfg, P, lambda T: saved(T, 0, sweep=True), layers, lt, stage)
    if kept_graphs:  # replay.keep_prompt_graph_mib: alive from their capture until the sweep frees them
        out["capture"] += kept_graphs
        out["replay"] += kept_graphs
        out["prompt_backward"] = max(out["prompt_backward"], kept_graphs + one_grad)
    staging = staging_bytes(layers, m, mem, p.tp, captured, [lt[i] for i in stage], p.cp)
    for ph in ("capture", "replay") + (("prompt_backward",) if exact else ()):
        out[ph] += staging
    return out


def _check_inputs(P, R, G) -> None:
    for name, v in (("prompt length", P), ("response length", R), ("group size", G)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} {v!r}: must be a positive integer")


def stage_plan(family, cfg, P: int, R: int, G: int, world_size: int, s: int, on_cuda: bool,
               grads: str = "train") -> tuple[dict, dict]:
    """({component: device bytes}, {component: host bytes}) of one rank of pipeline stage `s` (the
    module docstring's terms)."""
    from longstraw_mcore.planner.state import grad_homes, state_homes

    m, p, t, mem = cfg.model, cfg.parallel, cfg.train, cfg.memory
    dp = p.dp_for(world_size)
    stages = p.stage_layers(m.num_layers)
    e = _elem(m.dtype)
    captured = -(-(P - 1) // p.cp)
    exact = cfg.replay.mode == "exact"
    chunks = -(-(P - 1) // cfg.replay.chunk_len)
    shards = dp * p.cp
    first = sum(stages[:s])
    layers = range(first, first + stages[s])
    types = [m.layer_types[i] for i in layers]
    weights, n = stage_weights(family, cfg, stages, s)
    out, host = {"weights": weights}, {"gradients": 0}
    sharded = cfg.uses_distributed_optimizer() or t.grad_reduction == "micro_step"
    phases = phase_bytes(family, cfg, P, R, G, layers, s == p.pp - 1, "cuda" if on_cuda else "cpu")
    later = max(v for k, v in phases.items() if k != "capture")
    if t.grad_reduction == "micro_step":
        out["gradients"], staged = micro_step_gradients(family, cfg, stages, s, n, shards, later, grads == "plain")
        host.update(staged)
    elif grads == "plain":
        out["gradients"] = n * e
    else:
        out["gradients"] = n * (4 if m.dtype == "bfloat16" else e)
    (out["optimizer"], host["optimizer"]), host["optimizer_grads"] = optimizer_terms(cfg, n, shards, sharded)
    out["prompt_state"], host["prompt_state"] = state_homes(family.layers, m, mem, p.tp, captured,
                                                            chunks if exact else 0, types, p.cp)
    out["prompt_state_grad"], host["prompt_state_grad"] = (grad_homes(family.layers, m, mem, p.tp, captured, types)
                                                           if exact else (0, 0))
    out["activations"] = max(phases.values())
    if grads == "plain":  # no .grad and no state gradient exists yet while the prompt is captured
        out["activations"] = max(later, phases["capture"] - out["gradients"] - out["prompt_state_grad"])
    if cfg.grpo.objective == "ppo":  # the critic: same ranks, time-shared (critic_terms)
        critic, critic_host = critic_terms(family, cfg, stages, s, shards, sharded)
        out.update(critic)
        host.update(critic_host)
    out["comm_buffers"] = NCCL_BYTES if on_cuda else 0
    out["allocator_slack"] = int(SLACK * sum(out.values())) if on_cuda else 0
    return out, host


def optimizer_terms(cfg, n: int, shards: int, sharded: bool) -> tuple[tuple[int, int], int]:
    """((device, host) bytes of the optimizer state of n trainable parameters, the host's float32 gradient
    copy under memory.optimizer_offload): Adam's moments (+ a float32 master copy below float32 models), or
    micro_step's AdamW moments and master shard in the shard dtype; sharded over dp x cp when `sharded`."""
    m = cfg.model
    if cfg.train.grad_reduction == "micro_step":  # AdamW's two moments and the master shard, in the shard dtype
        moments = n * 3 * (8 if m.dtype == "float64" else 4)  # (train/zero2.py: float64 for float64 models)
    else:
        moments = n * 8 + (n * 4 if m.dtype == "bfloat16" else 0)
    optimizer = -(-moments // shards) if sharded else moments
    off = cfg.memory.optimizer_offload
    return (0, optimizer) if off else (optimizer, 0), ((-(-n * 4 // shards) if sharded else n * 4) if off else 0)


def critic_terms(family, cfg, stages: list[int], s: int, shards: int, sharded: bool) -> tuple[dict, dict]:
    """PPO's critic (grpo.objective=ppo), planned as the policy's dimensions with a value head (`--critic
    policy`, or a critic of the policy's size: the expected case) on the same ranks, time-shared: its
    weights, its DDP gradient buffer and its Adam state stay beside the policy's for the whole step (device,
    or host under memory.optimizer_offload), while its prompt state and activations exist only during its
    own pass, which runs before the policy's and is no larger (a scalar head in place of the vocabulary's
    logits), so the policy's terms already bound them. Its optimizer follows the policy's formulas
    (optimizer_terms); its gradients are planned as a full buffer (under train.grad_reduction=micro_step
    an upper bound: there it is reduce-scattered into shards). With `critic_adapter.rank > 0` its weights are
    the frozen base in critic_adapter.base_dtype plus the adapters, and only the adapters take gradients and
    Adam state (its value head, [1, hidden] + 1, is left out of those)."""
    import dataclasses

    from longstraw_mcore.checkpoint import heads

    m = cfg.model
    e = _elem(m.dtype)
    fam = dataclasses.replace(family, name=f"{family.name}:critic", checkpoint=heads.mapping(family.checkpoint,
                                                                                              "token_value"))
    weights, n = stage_weights(fam, dataclasses.replace(cfg, adapter=cfg.critic_adapter.as_adapter()), stages, s)
    (device_opt, host_opt), host_grads = optimizer_terms(cfg, n, shards, sharded)
    device = {"critic_weights": weights, "critic_gradients": n * (4 if m.dtype == "bfloat16" else e),
              "critic_optimizer": device_opt}
    return device, {"critic_optimizer": host_opt, "critic_optimizer_grads": host_grads}


def plan_both(family, cfg, P: int, R: int, G: int, world_size: int, cuda: bool | None = None,
              grads: str = "train") -> tuple[dict, dict]:
    """(device, host): the {component: bytes} of the rank with the most device bytes and of the rank
    with the most host bytes (pipeline stages differ; TP ranks are counted as the largest)."""
    _check_inputs(P, R, G)
    on_cuda = cfg.resolved_device() == "cuda" if cuda is None else cuda
    plans = [stage_plan(family, cfg, P, R, G, world_size, s, on_cuda, grads) for s in range(cfg.parallel.pp)]
    device = max((d for d, _ in plans), key=lambda d: sum(d.values()))  # the first of equals: stage order
    host = max((h for _, h in plans), key=lambda h: sum(h.values()))
    return device, host


def plan_memory(family, cfg, P: int, R: int, G: int, world_size: int, cuda: bool | None = None,
                grads: str = "train") -> dict:
    """{component: device bytes} for the largest rank of the run `cfg` (a RunConfig) on `world_size`
    ranks at prompt P, response R, group size G (`cuda`: on GPUs; default: the config's device); bad
    input raises ConfigError before anything is computed. `grads="plain"`: gradients as plain `.grad`
    tensors in the model dtype (a model without DDP, as tools/bench_replay.py runs it)."""
    return plan_both(family, cfg, P, R, G, world_size, cuda, grads)[0]


def plan_host(family, cfg, P: int, R: int, G: int, world_size: int, cuda: bool | None = None,
              grads: str = "train") -> dict:
    """{component: host bytes} of the rank with the most host bytes (the module docstring's host side;
    all 0 with every memory switch off). Per node: times node_ranks(world_size, gpus per node)."""
    return plan_both(family, cfg, P, R, G, world_size, cuda, grads)[1]


STEP_COMPONENTS = ("gradients", "prompt_state", "prompt_state_grad", "activations")


def step_peak_bytes(family, cfg, P: int, R: int, G: int, world_size: int, cuda: bool) -> int:
    """What a measured step peak above the parameters counts (tools/bench_replay.py, the H200 data,
    tools/plan_vs_measured.py): plain `.grad` tensors allocated in the step, the prompt state and its
    gradient, the worst phase's activations, and (CUDA) the allocator slack on those. Device bytes;
    `step_host_bytes` is the host side."""
    per = plan_memory(family, cfg, P, R, G, world_size, cuda=cuda, grads="plain")  # (its kernels; no NCCL / slack terms)
    return int(sum(per[k] for k in STEP_COMPONENTS) * (1 + (SLACK if cuda else 0)))


def no_optimizer_plan(family, cfg, P: int, R: int, G: int, world_size: int) -> dict:
    """{component: device bytes} of `plan_memory` for a step that builds no optimizer (`longstraw validate`,
    tools/bench_ladder.py), held against an allocator's measured peak: no optimizer state and no
    allocator slack (an allocated peak holds no fragmentation)."""
    planned = plan_memory(family, cfg, P, R, G, world_size)
    planned["optimizer"] = 0
    if "critic_optimizer" in planned:
        planned["critic_optimizer"] = 0
    planned["allocator_slack"] = 0
    return planned


def step_host_bytes(family, cfg, P: int, R: int, G: int, world_size: int) -> int:
    """The host side of `step_peak_bytes`: the prompt state and its exact-mode gradient that
    memory.state_offload keeps in host memory, and memory.grad_offload's gradient buffers and shards
    (a step builds no optimizer there)."""
    host = plan_host(family, cfg, P, R, G, world_size, cuda=False, grads="plain")
    return host["prompt_state"] + host["prompt_state_grad"] + host["gradients"] + host.get("gradient_shards", 0)


def fits_limits(family, cfg, P: int, R: int, G: int, world_size: int, device_bytes: int,
                host_bytes_per_node: int | None = None, gpus_per_node: int = GPUS_PER_NODE,
                cuda: bool | None = None) -> bool:
    """Whether the plan fits `device_bytes` per rank and (when given) `host_bytes_per_node` per node."""
    device, host = plan_both(family, cfg, P, R, G, world_size, cuda)
    if sum(device.values()) > device_bytes:
        return False
    return host_bytes_per_node is None or sum(host.values()) * node_ranks(world_size, gpus_per_node) \
        <= host_bytes_per_node


def max_prompt_len(family, cfg, R: int, G: int, world_size: int, device_bytes: int, cuda: bool | None = None,
                   limit: int = 1 << 34, host_bytes_per_node: int | None = None,
                   gpus_per_node: int = GPUS_PER_NODE) -> int:
    """The largest P whose plan fits `device_bytes` per rank and, when given, `host_bytes_per_node` per
    node (0 if none does). Both grow with P, so a doubling then a bisection finds it."""
    def fits(P):
        return fits_limits(family, cfg, P, R, G, world_size, device_bytes, host_bytes_per_node, gpus_per_node, cuda)

    if not fits(2):
        return 0
    lo, hi = 2, 4
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
