"""Branch replay of one prompt group: execute the plan (replay/plan.py) step by step.

    capture         prompt[:-1] under no_grad, one chunk per step; each layer's state kind keeps
                    what later tokens need (peak activations: one chunk)
    replay          [prompt[-1]] + y_b[:-1] at positions P-1.. with autograd against the state ->
                    log-probs of y_b -> the branch's loss term -> backward; the graph (the branch's
                    own K/V and recurrent updates: its scratch) is freed before the next step
    prompt_backward exact mode: chunk c recomputed with autograd against the earlier chunks' state
                    (on the last stage its last layer only as far as its state), seeded with the
                    gradient accumulated for the state it produces; one torch.autograd.backward
                    per chunk deposits into the parameters and the earlier chunks' state gradient

detached = sum_b dL_b/dtheta with the state held constant (LongStraw's truncated gradient);
exact    = dL/dtheta including (sum_b dL_b/dS) dS/dtheta, i.e. full-sequence GRPO.
The engine reaches the model only through `models/replay_interface.py` and the state only through
its kinds (prompt_state/); any TP and CP (under context parallelism a rank captures and recomputes
its zig-zag share of every chunk and replays every branch whole: prompt_state/contexts.py). With
pipeline stages the same plan runs through Megatron's pipeline engine (replay/stages.py). The
objective is per-branch terms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from longstraw_mcore.config import ReplayConfig
from longstraw_mcore.families import get_family
from longstraw_mcore.parallel.cp import CPLayout, local_count, local_positions
from longstraw_mcore.prompt_state.containers import PromptState, allocate
from longstraw_mcore.prompt_state.contexts import CaptureContext, RecomputeContext, ReplayContext
from longstraw_mcore.replay.plan import Step, chunk_spans, plan_group, replay_steps

__all__ = ["ReplayConfig", "BranchResult", "capture", "replay_branches", "run_group", "score_group", "make_leaves",
           "stores_attention_probs", "execute"]


def _core(model):
    """The model behind a DDP wrapper: the replay interface lives there (DDP's forward only calls it)."""
    return getattr(model, "module", model)


@dataclass
class BranchResult:
    logprobs: torch.Tensor          # [R] detached
    stats: dict = field(default_factory=dict)


BranchLoss = Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]]


def stores_attention_probs(model, captured: int, cfg: ReplayConfig, batch: int, tokens: int) -> bool:
    """Whether a branch of `batch` x `tokens` against `captured` prompt positions keeps its attention
    probabilities for the backward (they fit `cfg.attn_probs_budget_mib`) instead of recomputing them."""
    if cfg.attn_probs_budget_mib <= 0 or captured == 0:
        return False
    core = _core(model)
    kinds = get_family(core.model_cfg.family).state_kinds
    need = sum(getattr(kinds[t], "probs_bytes", lambda *a: 0)(core.model_cfg, core.tp_size, batch, tokens, captured)
               for t in core.state_layers().values())
    return need <= cfg.attn_probs_budget_mib * 2**20


@dataclass
class _Group:
    """The inputs a plan runs on."""

    prefix: torch.Tensor            # [1, P-1] prompt ids before the last
    prompt_last: int
    responses: list[list[int]]
    loss_fn: BranchLoss | None
    cfg: ReplayConfig


def branch_batch(g: _Group, bs: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [len(bs), R] of a replay micro-step, right-padded (causal: pads never reach
    real positions)."""
    R = max(len(g.responses[b]) for b in bs)
    ids = torch.zeros(len(bs), R, dtype=torch.long, device=device)
    tgt = torch.zeros(len(bs), R, dtype=torch.long, device=device)
    for i, b in enumerate(bs):
        r = g.responses[b]
        ids[i, :len(r)] = torch.tensor([g.prompt_last] + r[:-1], device=device)
        tgt[i, :len(r)] = torch.tensor(r, device=device)
    return ids, tgt


def replay_context(core, state: PromptState, step: Step, g: _Group, layout, grad: bool) -> ReplayContext:
    R = max(len(g.responses[b]) for b in step.branches)
    store = grad and stores_attention_probs(core, state.length, g.cfg, len(step.branches), R)
    return ReplayContext(state, batch=len(step.branches), store_probs=store, layout=layout)


def branch_losses(core, hidden: torch.Tensor, tgt: torch.Tensor, step: Step, g: _Group):
    """Per-token log-probs of the micro-step's branches from the last layer's output, and (with a
    loss function) the sum of their loss terms: (total or None, {branch: BranchResult})."""
    logp = core.token_logprobs(hidden, tgt, g.cfg.logprob_chunk)
    total, out = None, {}
    for i, b in enumerate(step.branches):
        lp = logp[i, :len(g.responses[b])]
        stats = {}
        if g.loss_fn is not None:
            loss, stats = g.loss_fn(b, lp)
            total = loss if total is None else total + loss
        out[b] = BranchResult(lp.detach(), stats)
    return total, out


def _replay(core, state: PromptState, step: Step, g: _Group, device, layout) -> dict[int, BranchResult]:
    grad = g.loss_fn is not None
    ids, tgt = branch_batch(g, step.branches, device)
    with torch.set_grad_enabled(grad):
        hidden = core.forward_hidden(ids, replay_context(core, state, step, g, layout, grad))
        total, out = branch_losses(core, hidden, tgt, step, g)
        if grad:
            total.backward()  # frees this micro-step's graph (its scratch) before the next one
    return out


def _micro_step_done(model) -> None:
    """Gradients reduced per micro-step (train/zero2.py) hook in here, after every backward."""
    done = getattr(model, "micro_step_done", None)
    if done is not None:
        done()


def _chunk_ids(g: _Group, span: tuple[int, int], layout: CPLayout | None) -> torch.Tensor:
    """The prompt tokens of a chunk this rank runs: all of them, or under CP its zig-zag pieces."""
    s0, s1 = span
    if layout is None:
        return g.prefix[:, s0:s1]
    idx = torch.tensor(local_positions(s1 - s0, layout.size, layout.rank), dtype=torch.long) + s0
    return g.prefix[:, idx.to(g.prefix.device)]


def _prompt_backward(core, state: PromptState, step: Step, g: _Group, layout: CPLayout | None) -> None:
    with torch.enable_grad():
        core.forward_state(_chunk_ids(g, step.span, layout), RecomputeContext(state, step.index, layout))
    torch.autograd.backward(state.outputs(step.index), chunk_seeds(state, step.index, layout))
    state.finish_chunk(step.index)


def chunk_seeds(state: PromptState, chunk: int, layout: CPLayout | None) -> list[torch.Tensor]:
    """The gradients a chunk's recompute is seeded with (scaled by CP: each rank recomputes 1/n of the
    chunk's tokens, see prompt_state/contexts.py)."""
    grads = state.seed_grads(chunk)
    return grads if layout is None else [x * layout.size for x in grads]


def capture_chunk(core, state: PromptState, step: Step, g: _Group, layout: CPLayout | None, keep: bool):
    """One capture step on this rank's layers: record the chunk's bounds, run it without autograd
    (under CP this rank's pieces of it); returns the output of this rank's last layer."""
    s0, s1 = step.span
    cp, rank = (layout.size, layout.rank) if layout is not None else (1, 0)
    ls0 = state.local_bounds[-1][1] if state.local_bounds else 0
    state.chunk_bounds.append(step.span)
    state.local_bounds.append((ls0, ls0 + local_count(s1 - s0, cp, rank)))
    with torch.no_grad():
        out = core.forward_hidden(_chunk_ids(g, step.span, layout), CaptureContext(state, step.index, keep, layout))
    state.length = s1
    return out


def new_state(core, plan: list[Step], g: _Group, layout: CPLayout | None) -> PromptState:
    """This rank's empty state for the plan's capture chunks (its layers; under CP its share)."""
    cp, rank = (layout.size, layout.rank) if layout is not None else (1, 0)
    if layout is not None and 0 < g.prefix.shape[1] < cp:
        raise ValueError(f"a prompt of {g.prefix.shape[1] + 1} tokens is too short for {cp} context-parallel "
                         f"ranks (each needs at least one of the prompt[:-1] positions)")
    spans = [st.span for st in plan if st.phase == "capture"]
    local = sum(local_count(e - s, cp, rank) for s, e in spans)
    device = next(core.parameters()).device
    return allocate(core.model_cfg, core.state_layers(), core.tp_size, local, device,
                    kv=getattr(core.pg_collection, "tp_kv", None), spans=spans)


def _same_schedule_over_ep(core, plan: list[Step], g: _Group) -> None:
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
                             "capture chunks (prompt length / replay.chunk_len) and branches")


def execute(model, plan: list[Step], g: _Group, state: PromptState | None = None, state_grad: bool = False):
    """Run `plan` (against `state`, or a fresh one the plan captures); returns (results by branch,
    state, seconds per phase). `state_grad`: exact mode, the state gradient starts accumulating at
    the first replay step."""
    core = _core(model)
    device = next(core.parameters()).device
    layout = CPLayout.of(core.cp_group)
    _same_schedule_over_ep(core, plan, g)
    if state is None:
        state = new_state(core, plan, g, layout)
    if core.pg_collection.pp.size() > 1:  # the same plan through Megatron's pipeline engine
        from longstraw_mcore.replay.stages import execute_stages

        return execute_stages(model, plan, g, state, state_grad, layout)
    seconds: dict[str, float] = {}
    results: dict[int, BranchResult] = {}
    keep = g.cfg.mode == "exact"  # GDN kinds record the state entering each chunk for its recompute
    for i, step in enumerate(plan):
        t0 = time.perf_counter()
        if step.phase == "capture":
            capture_chunk(core, state, step, g, layout, keep)
            if i + 1 == len(plan) or plan[i + 1].phase != "capture":
                state.finish_capture(layout)
        elif step.phase == "replay":
            if state_grad:
                state.enable_grad()
                state_grad = False
            results.update(_replay(core, state, step, g, device, layout))
            if g.loss_fn is not None:
                _micro_step_done(model)
        elif step.phase == "prompt_backward":
            _prompt_backward(core, state, step, g, layout)
            _micro_step_done(model)
            if step.index == 0:
                state.release_grad()  # the state gradient is spent
        else:
            raise ValueError(f"unknown plan phase {step.phase!r}")
        seconds[step.phase] = seconds.get(step.phase, 0.0) + time.perf_counter() - t0
    return results, state, seconds


def _group(model, prompt: list[int], responses, loss_fn, cfg) -> _Group:
    device = next(_core(model).parameters()).device
    return _Group(torch.tensor([prompt[:-1]], device=device, dtype=torch.long), prompt[-1], responses, loss_fn, cfg)


@torch.no_grad()
def capture(model, prompt_prefix: torch.Tensor, cfg: ReplayConfig, tp: int | None = None) -> PromptState:
    """Run `prompt_prefix` [1, P-1] through the model chunk by chunk, keeping only the prompt state."""
    plan = [Step("capture", c, span) for c, span in enumerate(chunk_spans(prompt_prefix.shape[1], cfg.chunk_len))]
    g = _Group(prompt_prefix, 0, [], None, cfg)
    return execute(model, plan, g)[1]


def make_leaves(state: PromptState) -> PromptState:
    """Exact mode: start accumulating the state gradient (over the branches replayed next)."""
    state.enable_grad()
    return state


def replay_branches(model, state: PromptState, prompt_last: int, responses: list[list[int]], order: list[int],
                    loss_fn: BranchLoss | None, cfg: ReplayConfig, leaves=None) -> list[BranchResult]:
    """Replay branches (one at a time, or batched) and back-propagate each branch's loss term against
    `state` (with its gradient accumulating if `make_leaves` was called on it). `loss_fn(b, logp [R_b])`
    returns (scalar, stats); None scores without autograd."""
    assert leaves is None or leaves is state, "pass the state that make_leaves() returned"
    g = _Group(torch.zeros(1, state.length, dtype=torch.long), prompt_last, responses, loss_fn, cfg)
    results = execute(model, replay_steps(order, cfg.batch_branches), g, state)[0]
    return [results[b] for b in sorted(results)]


def run_group(model, prompt: list[int], responses: list[list[int]], loss_fn: BranchLoss, cfg: ReplayConfig,
              tp: int | None = None, order: list[int] | None = None, timed: bool = False):
    """Capture, replay every branch with `loss_fn`, and (exact mode) the prompt backward.

    Returns (results, state) or, with `timed`, (results, state, seconds per phase)."""
    t0 = time.perf_counter()
    order = list(range(len(responses))) if order is None else order
    plan = plan_group(len(prompt) - 1, cfg.chunk_len, order, cfg.mode, cfg.batch_branches)
    results, state, seconds = execute(model, plan, _group(model, prompt, responses, loss_fn, cfg),
                                      state_grad=cfg.mode == "exact" and loss_fn is not None)
    seconds.setdefault("capture", 0.0)
    seconds.setdefault("replay", 0.0)
    if cfg.mode == "exact" and state.length > 0:
        seconds.setdefault("prompt_backward", 0.0)
    seconds["total"] = time.perf_counter() - t0
    ordered = [results[b] for b in sorted(results)]
    return (ordered, state, seconds) if timed else (ordered, state)


def score_group(model, prompt: list[int], responses: list[list[int]], cfg: ReplayConfig, tp: int | None = None,
                state: PromptState | None = None) -> tuple[list[torch.Tensor], PromptState]:
    """Per-token log-probs of every branch without autograd (old / reference scoring)."""
    if state is None:
        state = capture(model, _group(model, prompt, responses, None, cfg).prefix,
                        ReplayConfig(mode="detached", chunk_len=cfg.chunk_len))
    res = replay_branches(model, state, prompt[-1], responses, list(range(len(responses))), None, cfg)
    return [r.logprobs for r in res], state
