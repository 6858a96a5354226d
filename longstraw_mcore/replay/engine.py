"""Branch replay of one prompt group: the public entry points, and the dispatch of a plan
(replay/plan.py, with the state's transitions) to its executor: replay/local.py at pipeline size 1,
replay/pipeline.py through Megatron's pipeline engine otherwise. The steps themselves are
replay/steps.py.

    run_group        capture, replay every branch with its loss term, and in exact mode the prompt backward
    score_group      per-token log-probs of every branch without autograd (old / reference scoring)
    capture          the prompt state alone;  replay_branches  branches against a given state
    make_leaves      exact mode by hand: start accumulating the state gradient before replay_branches

detached = sum_b dL_b/dtheta with the state held constant (LongStraw's truncated gradient);
exact    = dL/dtheta including (sum_b dL_b/dS) dS/dtheta, i.e. full-sequence GRPO.
Any TP, CP and PP (under context parallelism a rank captures and recomputes its zig-zag share of every
chunk and replays every branch whole: prompt_state/contexts.py). The objective is per-branch terms.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from longstraw_mcore.config import ReplayConfig
from longstraw_mcore.parallel.cp import CPLayout
from longstraw_mcore.prompt_state.containers import PromptState
from longstraw_mcore.replay.local import execute_local
from longstraw_mcore.replay.pipeline import execute_pipeline
from longstraw_mcore.replay.plan import Step, chunk_spans, plan_group, replay_steps, with_transitions
from longstraw_mcore.replay.tree import build_tree, shares, tree_pieces, tree_steps
from longstraw_mcore.replay.steps import (BranchLoss, BranchResult, GroupInputs, core_of, new_state,
                                          prompt_is_frozen, same_schedule_over_ep, stores_attention_probs)

__all__ = ["ReplayConfig", "BranchResult", "capture", "replay_branches", "run_group", "score_group", "make_leaves",
           "stores_attention_probs", "execute", "group_replay_steps", "replayed_tokens", "steps_tokens",
           "replay_pieces"]


def execute(model, plan: list[Step], g: GroupInputs, state: PromptState | None = None, state_grad: bool = False):
    """Run `plan` (against `state`, or a fresh one the plan captures); returns (results by branch,
    state, seconds per phase). `state_grad`: exact mode, the state gradient starts accumulating at
    the first replay step."""
    core = core_of(model)
    layout = CPLayout.of(core.cp_group)
    same_schedule_over_ep(core, plan)
    if g.watch is not None:
        g.watch.begin(plan, g.responses)
    if state is None:
        state = new_state(model, plan, g, layout)
    run = execute_pipeline if core.pg_collection.pp.size() > 1 else execute_local
    return run(model, with_transitions(plan, state_grad), g, state, layout)


def _lengths(responses: list[list[int]]) -> list[int]:
    return [len(r) for r in responses]


def _ep_group(model):
    ep = getattr(core_of(model).pg_collection, "ep", None)
    return ep if ep is not None and ep.size() > 1 else None


def _tree(model, responses: list[list[int]], cfg: ReplayConfig):
    """The group's prefix tree when it replays as one (replay.prefix_tree, responses sharing tokens),
    else None. Expert parallelism: the EP ranks' MoE all-to-alls need the same steps, so where the
    ranks' groups (data parallel) would replay trees of different shapes or micro-steps, all of them
    replay flat (the same numbers); an all_gather_object over the EP group decides, on every EP rank
    alike."""
    if not cfg.prefix_tree:
        return None
    root = build_tree(responses) if len(responses) >= 2 else None
    root = root if root is not None and shares(root) else None
    ep = _ep_group(model)
    if ep is not None:
        import torch.distributed as dist

        mine = None if root is None else [(s.phase, len(s.branches))
                                          for s in tree_steps(root, _lengths(responses), cfg.batch_tokens)]
        every = [None] * ep.size()
        dist.all_gather_object(every, mine, group=ep)
        if any(e != mine for e in every):
            return None
    return root


def _flat_lengths(model, responses: list[list[int]], cfg: ReplayConfig) -> list[int]:
    """The lengths a flat group's micro-steps are cut by: its own, or under expert parallelism (EP
    ranks in lockstep, replay/steps.py `same_schedule_over_ep`) the largest of each branch's length
    over the EP group's groups when they have as many branches, so that every EP rank cuts the same
    micro-steps (a rank's own padded batch is then no larger than the budget)."""
    mine = _lengths(responses)
    ep = _ep_group(model)
    if ep is None or cfg.batch_tokens == 0:
        return mine
    import torch.distributed as dist

    every = [None] * ep.size()
    dist.all_gather_object(every, mine, group=ep)
    if any(len(e) != len(mine) for e in every):
        return mine  # (same_schedule_over_ep refuses the plan, naming the difference)
    return [max(col) for col in zip(*every)]


def group_replay_steps(model, responses: list[list[int]], cfg: ReplayConfig, order: list[int] | None = None):
    """A group's replay steps: its prefix tree's (replay/tree.py) where responses share tokens, or its
    branches (in `order`, or as given) in micro-steps under replay.batch_tokens."""
    root = _tree(model, responses, cfg) if order is None else None
    if root is not None:
        return tree_steps(root, _lengths(responses), cfg.batch_tokens)
    return replay_steps(list(range(len(responses))) if order is None else order,
                        _flat_lengths(model, responses, cfg), cfg.batch_tokens)


def replayed_tokens(model, responses: list[list[int]], cfg: ReplayConfig) -> int:
    """Response tokens a group's replay runs: each shared segment once (prefix tree), else every token."""
    return steps_tokens(group_replay_steps(model, responses, cfg), responses)


def steps_tokens(steps, responses: list[list[int]]) -> int:
    """Response tokens the replay steps run: a segment's once, a replay step's from its depth on."""
    return sum(st.span[1] - st.span[0] if st.phase == "segment" else
               sum(len(responses[b]) - st.span[0] for b in st.branches) if st.phase == "replay" else 0
               for st in steps)


def replay_pieces(model, responses: list[list[int]], cfg: ReplayConfig) -> list[tuple[int, int]]:
    """(tokens, depth) of what a group's replay runs (the FLOP model's input: planner/flops.py)."""
    root = _tree(model, responses, cfg)
    return tree_pieces(root, responses) if root is not None else [(len(r), (), False) for r in responses]


def _group(model, prompt: list[int], responses, loss_fn, cfg, watch=None) -> GroupInputs:
    device = next(core_of(model).parameters()).device
    return GroupInputs(torch.tensor([prompt[:-1]], device=device, dtype=torch.long), prompt[-1], responses, loss_fn,
                       cfg, watch)


@torch.no_grad()
def capture(model, prompt_prefix: torch.Tensor, cfg: ReplayConfig) -> PromptState:
    """Run `prompt_prefix` [1, P-1] through the model chunk by chunk, keeping only the prompt state."""
    plan = [Step("capture", c, span) for c, span in enumerate(chunk_spans(prompt_prefix.shape[1], cfg.chunk_len))]
    return execute(model, plan, GroupInputs(prompt_prefix, 0, [], None, cfg))[1]


def make_leaves(state: PromptState) -> PromptState:
    """Exact mode: start accumulating the state gradient (over the branches replayed next)."""
    state.enable_grad()
    return state


def replay_branches(model, state: PromptState, prompt_last: int, responses: list[list[int]], order: list[int],
                    loss_fn: BranchLoss | None, cfg: ReplayConfig, leaves=None) -> list[BranchResult]:
    """Replay branches (in micro-steps under replay.batch_tokens) and back-propagate each branch's loss term against
    `state` (with its gradient accumulating if `make_leaves` was called on it). `loss_fn(b, logp [R_b])`
    returns (scalar, stats); None scores without autograd."""
    assert leaves is None or leaves is state, "pass the state that make_leaves() returned"
    g = GroupInputs(torch.zeros(1, state.length, dtype=torch.long), prompt_last, responses, loss_fn, cfg)
    results = execute(model, replay_steps(order, _lengths(responses), cfg.batch_tokens), g, state)[0]
    return [results[b] for b in sorted(results)]


def run_group(model, prompt: list[int], responses: list[list[int]], loss_fn: BranchLoss, cfg: ReplayConfig,
              order: list[int] | None = None, timed: bool = False, state: PromptState | None = None,
              replay: list[Step] | None = None, watch=None):
    """Capture, replay every branch with `loss_fn`, and (exact mode) the prompt backward. `state`: the
    prompt's state captured before (adapter.prompt=frozen: it holds no trainable weight), replayed
    against without a capture; `replay`: the group's replay steps decided before (group_replay_steps);
    `watch`: progress and safe points (replay/watch.py).

    Returns (results, state) or, with `timed`, (results, state, seconds per phase)."""
    t0 = time.perf_counter()
    replay = group_replay_steps(model, responses, cfg, order) if replay is None else replay
    if state is not None:
        if not prompt_is_frozen(model):
            raise ValueError("run_group(state=...): a captured state is reused only with adapter.prompt=frozen")
        results, state, seconds = execute(model, replay,
                                          _group(model, prompt, responses, loss_fn, cfg, watch), state)
        seconds.setdefault("replay", 0.0)
        seconds["capture"], seconds["total"] = 0.0, time.perf_counter() - t0
        ordered = [results[b] for b in sorted(results)]
        return (ordered, state, seconds) if timed else (ordered, state)
    # adapter.prompt=frozen: the prompt state depends on no trainable weight, so the exact gradient is
    # the detached one and the prompt sweep is skipped
    if prompt_is_frozen(model) and cfg.mode == "exact":
        cfg = dataclasses.replace(cfg, mode="detached")
    mode = cfg.mode
    plan = plan_group(len(prompt) - 1, cfg.chunk_len, replay, mode)
    results, state, seconds = execute(model, plan, _group(model, prompt, responses, loss_fn, cfg, watch),
                                      state_grad=mode == "exact" and loss_fn is not None)
    seconds.setdefault("capture", 0.0)
    seconds.setdefault("replay", 0.0)
    if mode == "exact" and state.length > 0:
        seconds.setdefault("prompt_backward", 0.0)
    seconds["total"] = time.perf_counter() - t0
    ordered = [results[b] for b in sorted(results)]
    return (ordered, state, seconds) if timed else (ordered, state)


def score_group(model, prompt: list[int], responses: list[list[int]], cfg: ReplayConfig,
                state: PromptState | None = None) -> tuple[list[torch.Tensor], PromptState]:
    """Per-token log-probs of every branch without autograd (old / reference scoring)."""
    if state is None:
        state = capture(model, _group(model, prompt, responses, None, cfg).prefix,
                        ReplayConfig(mode="detached", chunk_len=cfg.chunk_len))
    g = _group(model, prompt, responses, None, cfg)
    results = execute(model, group_replay_steps(model, responses, cfg), g, state)[0]
    return [results[b].logprobs for b in sorted(results)], state
