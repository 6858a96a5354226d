"""One step of a replay plan (replay/plan.py) on this rank's layers: what both executors run.

    capture_chunk     prompt chunk under no_grad (under CP this rank's zig-zag pieces; on the last stage its
                      last layer only as far as its state); each layer's state kind keeps what later tokens
                      need (peak activations: one chunk)
    replay            [prompt[-1]] + y_b[:-1] at positions P-1.. against the state -> log-probs of y_b ->
                      the branch's loss term (`replay_inputs`, `replay_context`, `branch_losses`; at pp = 1
                      `replay_step` also runs the backward, which frees the graph: the branch's own K/V and
                      recurrent updates are its scratch)
    prompt_backward   exact mode: chunk c recomputed with autograd against the earlier chunks' state (on the
                      last stage its last layer only as far as its state), seeded with the gradient
                      accumulated for the state it produces (`chunk_seeds`)
    transitions       finish_capture, enable_grad, release_grad on the state (`transition`)

The engine reaches the model only through models/replay_interface.py and the state only through its
kinds (prompt_state/). `micro_step_done` is where gradients reduced per micro-step (train/zero2.py)
hook in, after every backward.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field
from typing import Callable

import torch

from longstraw_mcore.config import ReplayConfig
from longstraw_mcore.models.chunks import chunk_list
from longstraw_mcore.parallel.cp import CPLayout, local_count, local_positions
from longstraw_mcore.prompt_state.containers import PromptState, allocate
from longstraw_mcore.prompt_state.contexts import CaptureContext, RecomputeContext, ReplayContext
from longstraw_mcore.replay.plan import Step


def core_of(model):
    """The model behind a DDP wrapper: the replay interface lives there (DDP's forward only calls it). A rank's
    model chunks (parallel.vpp > 1: a list, models/chunks.py): its first chunk's, for what the chunks share
    (process groups, device, adapters' settings, the model config); `cores_of` for the layers."""
    return getattr(chunk_list(model)[0], "module", chunk_list(model)[0])


def cores_of(model) -> list:
    """This rank's model chunks (one at parallel.vpp = 1), each behind its DDP wrapper's `module`."""
    return [getattr(m, "module", m) for m in chunk_list(model)]


@dataclass
class BranchResult:
    logprobs: torch.Tensor          # [R] detached
    stats: dict = field(default_factory=dict)


BranchLoss = Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass
class GroupInputs:
    """The inputs a plan runs on."""

    prefix: torch.Tensor            # [1, P-1] prompt ids before the last
    prompt_last: int
    responses: list[list[int]]
    loss_fn: BranchLoss | None
    cfg: ReplayConfig
    watch: object = None                # replay/watch.Watch: progress and the safe points (None: neither)


def stores_attention_probs(model, captured: int, cfg: ReplayConfig, batch: int, tokens: int) -> bool:
    """Whether a branch of `batch` x `tokens` against `captured` prompt positions keeps its attention
    probabilities for the backward (they fit `cfg.attn_probs_budget_mib`) instead of recomputing them."""
    if cfg.attn_probs_budget_mib <= 0 or captured == 0:
        return False
    core = core_of(model)
    need = sum(k.state.probs_bytes(core.model_cfg, core.tp_size, batch, tokens, captured)
               for k in core.state_kinds().values())
    return need <= cfg.attn_probs_budget_mib * 2**20


def new_state(model, plan: list[Step], g: GroupInputs, layout: CPLayout | None) -> PromptState:
    """This rank's empty state for the plan's capture chunks (its layers, those of all its model chunks at
    parallel.vpp > 1; under CP its share)."""
    core = core_of(model)
    kinds = {n: k for c in cores_of(model) for n, k in c.state_kinds().items()}
    cp, rank = (layout.size, layout.rank) if layout is not None else (1, 0)
    if layout is not None and 0 < g.prefix.shape[1] < cp:
        raise ValueError(f"a prompt of {g.prefix.shape[1] + 1} tokens is too short for {cp} context-parallel "
                         f"ranks (each needs at least one of the prompt[:-1] positions)")
    spans = [st.span for st in plan if st.phase == "capture"]
    local = sum(local_count(e - s, cp, rank) for s, e in spans)
    device = next(core.parameters()).device
    mcfg = getattr(core, "memory", None)
    if mcfg is None or not mcfg.stages_state:
        return allocate(kinds, core.model_cfg, core.tp_size, local, device, kv=core.kv_group, spans=spans,
                        cp=(cp, rank))
    from longstraw_mcore.memory.staging import place

    # memory.state_offload / state_dtype=fp8: shapes first (meta), then each staged tensor's home
    state = allocate(kinds, core.model_cfg, core.tp_size, local, "meta", kv=core.kv_group, spans=spans, cp=(cp, rank))
    place(state, mcfg, device)
    return state


def in_ep_lockstep(model) -> bool:
    """Whether this rank's MoE layers exchange tokens with other data-parallel ranks (EP > 1): then every
    rank of the EP group must run each step of a plan (same_schedule_over_ep)."""
    ep = getattr(core_of(model).pg_collection, "ep", None)
    return ep is not None and ep.size() > 1


def same_schedule_over_ep(core, plan: list[Step]) -> None:
    """Expert parallelism: every MoE layer call is an all-to-all over the EP group, so its ranks must call
    every layer equally often, in the same order (lockstep); token counts may differ (the dispatcher
    exchanges them first). Ranks that replay different prompt groups (data parallel) may when the
    groups have the same steps: capture chunks, and branches per replay step; refuse otherwise."""
    ep = getattr(core.pg_collection, "ep", None)
    if ep is None or ep.size() == 1:
        return
    import torch.distributed as dist

    mine = [(s.phase, len(s.branches)) for s in plan]
    every = [None] * ep.size()
    dist.all_gather_object(every, mine, group=ep)
    for r, theirs in enumerate(every):
        if theirs != mine:
            raise ValueError(f"expert-parallel ranks run different replay schedules (this rank: {len(mine)} steps, "
                             f"first {mine[:2]}; EP rank {r}: {len(theirs)} steps, first {theirs[:2]}): their "
                             "all-to-alls need lockstep; give the data-parallel ranks prompt groups with as many "
                             "capture chunks (prompt length / replay.chunk_len) and branches, and prefix trees of "
                             "the same shape (or replay.prefix_tree=false)")


def transition(state: PromptState, step: Step, layout: CPLayout | None) -> None:
    """A lifecycle step of the plan (replay/plan.py `with_transitions`)."""
    if step.phase == "finish_capture":
        state.finish_capture(layout)
    elif step.phase == "enable_grad":
        state.enable_grad()
    elif step.phase == "release_grad":
        state.release_grad()  # the state gradient is spent
    else:
        raise ValueError(f"{step.phase!r} is not a state transition")


def chunk_ids(g: GroupInputs, span: tuple[int, int], layout: CPLayout | None) -> torch.Tensor:
    """The prompt tokens of a chunk this rank runs: all of them, or under CP its zig-zag pieces."""
    s0, s1 = span
    if layout is None:
        return g.prefix[:, s0:s1]
    idx = torch.tensor(local_positions(s1 - s0, layout.size, layout.rank), dtype=torch.long) + s0
    return g.prefix[:, idx.to(g.prefix.device)]


def capture_chunk(core, state: PromptState, step: Step, g: GroupInputs, layout: CPLayout | None, keep: bool):
    """One capture step on this rank's layers: record the chunk's bounds, run it without autograd
    (under CP this rank's pieces of it); returns the output of this rank's last layer, or None on the
    last pipeline stage, whose last layer runs only as far as its state (its output feeds nothing: the
    prompt's logits are never needed). `keep`: exact mode, GDN kinds record the state entering each
    chunk for its recompute."""
    s0, s1 = step.span
    cp, rank = (layout.size, layout.rank) if layout is not None else (1, 0)
    if len(state.chunk_bounds) == step.index:  # (once: a rank's model chunks share the state, parallel.vpp > 1)
        ls0 = state.local_bounds[-1][1] if state.local_bounds else 0
        state.chunk_bounds.append(step.span)
        state.local_bounds.append((ls0, ls0 + local_count(s1 - s0, cp, rank)))
    with torch.no_grad(), prompt_adapters(core):
        out = core.forward_state(chunk_ids(g, step.span, layout), CaptureContext(state, step.index, keep, layout))
    state.length = s1
    return out


def kept_chunks(core, state: PromptState, plan: list[Step], g: GroupInputs, layout: CPLayout | None) -> set[int]:
    """Exact mode's capture chunks captured with autograd and their graphs kept for the sweep
    (replay.keep_prompt_graph_mib): the last ones whose saved tensors, by the planner's estimate
    (planner/activations.py, the model's last layer only as far as its state), fit the budget together.
    None where the kept capture does not apply: pipeline stages, context parallelism, KV groups, staged
    state (memory.state_offload, state_dtype=fp8), layers other than attention and Gated DeltaNet."""
    budget = g.cfg.keep_prompt_graph_mib * 2**20
    if (g.cfg.mode != "exact" or budget <= 0 or g.loss_fn is None or layout is not None or core.kv_group is not None
            or core.pg_collection.pp.size() > 1 or prompt_is_frozen(core)
            or any(st.home for st in state.layers.values())):  # (staged: memory/staging.py place)
        return set()
    from longstraw_mcore.planner.activations import kind_bytes

    kinds = core.state_kinds()
    if any(k.state.kind not in ("attention_kv", "gdn_state") for k in kinds.values()):
        return set()
    last = max(kinds)
    chunks = [(st.index, st.span) for st in plan if st.phase == "capture"]
    captured = max((s1 for _, (_, s1) in chunks), default=0)
    kept, used = set(), 0
    for c, (s0, s1) in reversed(chunks):  # (the planner's estimate: planner/activations.py kept_graph_bytes)
        need = sum(kind_bytes(kinds[n], core.model_cfg, core.tp_size, s1 - s0, n - 1, captured,
                              produce_only=n == last) for n in kinds)
        if used + need > budget:
            break
        kept.add(c)
        used += need
    return kept


def capture_kept_chunk(core, state: PromptState, step: Step, g: GroupInputs) -> None:
    """A capture step whose autograd graph the sweep will back-propagate (`kept_chunks`): the state is
    stored as capture_chunk stores it, the chunk's outputs recorded as its recompute would record them."""
    from longstraw_mcore.prompt_state.contexts import KeptCaptureContext

    s0, s1 = step.span
    ls0 = state.local_bounds[-1][1] if state.local_bounds else 0
    state.chunk_bounds.append(step.span)
    state.local_bounds.append((ls0, ls0 + s1 - s0))
    with torch.enable_grad(), prompt_adapters(core):
        core.forward_state(chunk_ids(g, step.span, None), KeptCaptureContext(state, step.index))
    state.length = s1


def prompt_adapters(core):
    """The adapters at prompt positions: as they are, or off with adapter.prompt=frozen (the prompt
    state then depends on the frozen base only)."""
    aset = getattr(core, "adapters", None)
    return aset.disabled() if aset is not None and aset.cfg.prompt == "frozen" else contextlib.nullcontext()


def prompt_is_frozen(model) -> bool:
    """Whether no trainable weight acts at prompt positions (adapter.prompt=frozen): exact mode's prompt
    sweep would then add no gradient, and detached mode is exact."""
    aset = getattr(core_of(model), "adapters", None)
    return aset is not None and aset.cfg.prompt == "frozen"


def replay_inputs(g: GroupInputs, bs: tuple[int, ...], device, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [len(bs), R] of a replay micro-step, right-padded (causal: pads never reach
    real positions); `depth`: the response tokens a prefix tree's path already covers (replay/tree.py)."""
    R = max(len(g.responses[b]) - depth for b in bs)
    ids = torch.zeros(len(bs), R, dtype=torch.long, device=device)
    tgt = torch.zeros(len(bs), R, dtype=torch.long, device=device)
    for i, b in enumerate(bs):
        r = g.responses[b]
        ids[i, :len(r) - depth] = torch.tensor(([g.prompt_last] + r[:-1])[depth:], device=device)
        tgt[i, :len(r) - depth] = torch.tensor(r[depth:], device=device)
    return ids, tgt


def replay_context(core, state: PromptState, step: Step, g: GroupInputs, layout, grad: bool, path=None) -> ReplayContext:
    depth = step.span[0]
    R = max(len(g.responses[b]) - depth for b in step.branches)
    store = grad and (path is None or not path.stack) and stores_attention_probs(core, state.length, g.cfg, len(step.branches), R)
    return ReplayContext(state, batch=len(step.branches), store_probs=store, layout=layout, path=path)


def branch_losses(core, hidden: torch.Tensor, tgt: torch.Tensor, step: Step, g: GroupInputs, path=None):
    """Per-token log-probs of the micro-step's branches from the last layer's output (after the
    log-probs of the prefix tree's segments on `path`), and (with a loss function) the sum of their
    loss terms: (total or None, {branch: BranchResult})."""
    logp = core.token_outputs(hidden, tgt, g.cfg.logprob_chunk)
    depth = step.span[0]
    above = path.logprobs() if path is not None else []
    total, out = None, {}
    for i, b in enumerate(step.branches):
        lp = logp[i, :len(g.responses[b]) - depth]
        if above:
            lp = torch.cat([*above, lp])
        t, res = _branch_term(g, b, lp)
        total = t if total is None else total + t
        out[b] = res
    return total, out


def _branch_term(g: GroupInputs, b: int, lp: torch.Tensor):
    """(loss term or None, result) of response `b` from its whole log-prob vector."""
    if g.loss_fn is None:
        return None, BranchResult(lp.detach(), {})
    loss, stats = g.loss_fn(b, lp)
    return loss, BranchResult(lp.detach(), stats)


def replay_step(core, state: PromptState, step: Step, g: GroupInputs, device, layout, path=None) -> dict[int, BranchResult]:
    """A replay micro-step with its backward (pp = 1)."""
    grad = g.loss_fn is not None
    ids, tgt = replay_inputs(g, step.branches, device, step.span[0])
    with torch.set_grad_enabled(grad):
        hidden = core.forward_hidden(ids, replay_context(core, state, step, g, layout, grad, path))
        total, out = branch_losses(core, hidden, tgt, step, g, path)
        if grad:
            total.backward()  # frees this micro-step's graph (its scratch) before the next one
    return out


def segment_inputs(state: PromptState, step: Step, g: GroupInputs, device):
    """A prefix tree's segment step (replay/tree.py): its inputs and targets [1, b - a] (its first
    member's tokens at depths a..b) and the empty record its layers will fill."""
    from longstraw_mcore.prompt_state.segments import Segment

    a, b = step.span
    ids, tgt = replay_inputs(g, step.branches[:1], device, a)
    return ids[:, :b - a], tgt[:, :b - a], Segment(start=state.length + a, length=b - a)


def terminal_terms(g: GroupInputs, path, branches):
    """The loss terms of the responses ending at the segment on top of `path` (their whole log-probs
    are the path's): (their sum or None, {branch: BranchResult})."""
    lp = torch.cat(path.logprobs())
    total, out = None, {}
    for b in branches:
        t, out[b] = _branch_term(g, b, lp)
        total = t if total is None else total + t
    return total, out


def segment_forward(core, state: PromptState, path, step: Step, g: GroupInputs, device, layout) -> None:
    """A prefix tree's shared segment (replay/tree.py): replayed once below `path` (with autograd when
    there is a loss), its layers' state recorded, sealed into leaves and pushed on the path."""
    from longstraw_mcore.prompt_state.contexts import SegmentContext

    grad = g.loss_fn is not None
    ids, tgt, seg = segment_inputs(state, step, g, device)
    with torch.set_grad_enabled(grad):
        hidden = core.forward_hidden(ids, SegmentContext(state, path, seg, layout))
        logp = core.token_outputs(hidden, tgt, g.cfg.logprob_chunk)[0]
    seg.seal(logp, grad)
    path.stack.append(seg)


def segment_backward(core, path, step: Step, g: GroupInputs) -> dict[int, BranchResult]:
    """After a segment's children: the loss terms of the responses ending at it, then its one backward
    (seeded with what its children and those terms sent into its leaves); pops it off the path."""
    grad = g.loss_fn is not None
    with torch.set_grad_enabled(grad):
        total, out = terminal_terms(g, path, step.branches)
        if total is not None:
            total.backward()
    seg = path.stack.pop()
    if grad:
        roots, grads = seg.backward_roots()
        if roots:
            torch.autograd.backward(roots, grads)
    return out


def recompute_chunk(core, state: PromptState, step: Step, g: GroupInputs, layout: CPLayout | None):
    """Exact mode: chunk `step.index` recomputed with autograd against the earlier chunks' state; returns
    this stage's output (None on the last stage, which stops at its last layer's state)."""
    with torch.enable_grad(), prompt_adapters(core):
        return core.forward_state(chunk_ids(g, step.span, layout), RecomputeContext(state, step.index, layout))


def chunk_seeds(state: PromptState, chunk: int, layout: CPLayout | None, only=None) -> list[torch.Tensor]:
    """The gradients a chunk's recompute is seeded with (scaled by CP: each rank recomputes 1/n of the
    chunk's tokens, see prompt_state/contexts.py); `only`: one model chunk's layers (PromptState.outputs)."""
    grads = state.seed_grads(chunk, only)  # (host tensors with memory.state_offload: moved to the outputs' device)
    outs = state.outputs(chunk, only)
    grads = [g.to(o.device) for g, o in zip(grads, outs)]
    return grads if layout is None else [x * layout.size for x in grads]


def prompt_backward_step(core, state: PromptState, step: Step, g: GroupInputs, layout: CPLayout | None,
                         kept: bool = False) -> None:
    """One chunk of exact mode's reverse sweep (pp = 1): its recompute (none when its capture `kept` its
    graph) and one backward seeded with the state gradient accumulated so far."""
    if not kept:
        recompute_chunk(core, state, step, g, layout)
    # a state that no trainable weight reaches (adapters on some projections only: the first layer's
    # K/V from an unadapted projection of the frozen embedding) has no backward
    pairs = [(o, sd) for o, sd in zip(state.outputs(step.index), chunk_seeds(state, step.index, layout))
             if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [sd for _, sd in pairs])
    state.finish_chunk(step.index)


def micro_step_done(model) -> None:
    """Gradients reduced per micro-step (train/zero2.py) hook in here, after every backward."""
    done = getattr(model, "micro_step_done", None)
    if done is not None:
        done()
