"""The replay plan at pipeline size 1: its steps in order, one at a time (replay/steps.py).

Gradients are reduced per micro-step after every backward (a replay step with a loss, a chunk of the
prompt backward, a prefix tree's segment); a transition's seconds count towards the phase it closes
or opens (finish_capture: capture, enable_grad: replay, release_grad: prompt_backward); a prefix
tree's segments count as replay. Before each step is a safe point (replay/watch.py: where a run may
stop), after it the group's progress."""

from __future__ import annotations

import time

from longstraw_mcore.parallel.cp import CPLayout
from longstraw_mcore.prompt_state.containers import PromptState
from longstraw_mcore.prompt_state.segments import SegmentPath
from longstraw_mcore.replay import steps as S
from longstraw_mcore.replay.plan import Step

_TIMED_AS = {"finish_capture": "capture", "enable_grad": "replay", "release_grad": "prompt_backward"}
_REPLAY = ("segment", "segment_backward")  # a prefix tree's shared segments (replay/tree.py) count as replay


def execute_local(model, plan: list[Step], g: S.GroupInputs, state: PromptState, layout: CPLayout | None):
    """(results by branch, state, seconds per phase) of `plan` (transitions included) on this rank."""
    core = S.core_of(model)
    device = next(core.parameters()).device
    seconds: dict[str, float] = {}
    results: dict[int, S.BranchResult] = {}
    keep = g.cfg.mode == "exact"
    kept = S.kept_chunks(core, state, plan, g, layout)  # (exact mode: captured with their graphs for the sweep)
    path = SegmentPath()
    watch = g.watch
    for step in plan:
        if watch is not None:
            watch.before(step)  # a safe point: every rank of the lockstep group stops here, or none
        t0 = time.perf_counter()
        if step.phase in _TIMED_AS:
            S.transition(state, step, layout)
        elif step.phase == "capture" and step.index in kept:
            S.capture_kept_chunk(core, state, step, g)
        elif step.phase == "capture":
            S.capture_chunk(core, state, step, g, layout, keep)
        elif step.phase == "replay":
            results.update(S.replay_step(core, state, step, g, device, layout, path))
            if g.loss_fn is not None:
                S.micro_step_done(model)
        elif step.phase == "segment":
            S.segment_forward(core, state, path, step, g, device, layout)
        elif step.phase == "segment_backward":
            results.update(S.segment_backward(core, path, step, g))
            if g.loss_fn is not None:
                S.micro_step_done(model)
        elif step.phase == "prompt_backward":
            S.prompt_backward_step(core, state, step, g, layout, kept=step.index in kept)
            S.micro_step_done(model)
        else:
            raise ValueError(f"unknown plan phase {step.phase!r}")
        phase = "replay" if step.phase in _REPLAY else _TIMED_AS.get(step.phase, step.phase)
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
        if watch is not None:
            watch.done(step)
    return results, state, seconds
