"""Branch replay across pipeline stages: the plan (replay/plan.py) run through Megatron's pipeline engine.

Each stage keeps the prompt state of its own layers. A plan runs as at most two calls of Megatron's
schedule (`get_forward_backward_func`, shapes exchanged per micro-batch: `variable_seq_lengths`,
since capture chunks, CP shares and branches differ in length):

1. capture: the chunks are the micro-batches of a forward-only schedule, so stage s runs chunk c
   while stage s+1 runs chunk c-1; nothing keeps activations (no autograd).
2. replay (+ exact mode's prompt backward): one 1F1B schedule whose micro-batches are the replay
   steps (a branch, or a batch of branches) and then the capture chunks from last to first. A
   replay micro-batch installs the branch's replay context on every stage; the last stage turns
   its output into log-probs and the branch's loss. A chunk micro-batch recomputes the chunk with
   autograd against the earlier chunks' state on every stage (the last stage only as far as its
   layers' state); `_StageOutput` on each stage's output injects, when the backward reaches it, the
   gradient accumulated for the state that stage's layers produced (last stage first, then each
   stage as the hidden-state gradient arrives: the reverse sweep). Scoring without autograd
   (no loss function) runs the replay steps through a forward-only schedule.

Timeline, pp=2, G=4 branches b0..b3, exact mode with three capture chunks c0..c2 (recomputed as
r2, r1, r0), one slot per forward (F) or backward (B) of one micro-batch on one stage:

    capture    stage 0  Fc0 Fc1 Fc2 .
               stage 1  .   Fc0 Fc1 Fc2
    replay     stage 0  Fb0 Fb1 .   Bb0 Fb2 Bb1 Fb3 Bb2 Fr2 Bb3 Fr1 Br2 Fr0 Br1 .   Br0
    + sweep    stage 1  .   Fb0 Bb0 Fb1 Bb1 Fb2 Bb2 Fb3 Bb3 Fr2 Br2 Fr1 Br1 Fr0 Br0 .

A stage holds at most pp - s micro-batches in flight (1F1B), whatever G is. Stage 0 recomputes r2
before b3's backward and r1 before r2's: so a chunk's seeds are read when its backward starts,
never at its forward (by then, on that stage, every branch and every later chunk has run its
backward: 1F1B keeps each stage's backwards in micro-batch order), and the state kinds keep their
recompute records per chunk. When a micro-batch's whole backward has run on a stage (autograd's
end-of-backward callback), the stage finishes the chunk and calls the model's `micro_step_done`
(gradients reduced per micro-step, train/zero2.py).

Megatron divides each micro-batch's loss by the number of micro-batches; `_loss` hands it the loss
times that number so the gradient is the plain sum of the branches' terms, as at pp=1.

Megatron's interleaved (virtual) stages are not used: the model builds one chunk of layers per rank
and the state containers are per rank. What they would buy is a smaller bubble, (pp-1)/(M+pp-1)
of a schedule of M micro-batches, and here M is large where the time is: capture and the sweep run
one micro-batch per chunk (a 2M-token prompt in 16K chunks is 128), so their bubble is already small.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from longstraw_mcore.parallel.cp import CPLayout
from longstraw_mcore.prompt_state.containers import PromptState
from longstraw_mcore.prompt_state.contexts import RecomputeContext
from longstraw_mcore.replay import engine as E
from longstraw_mcore.replay.plan import Step


class _StageOutput(torch.autograd.Function):
    """Identity on a stage's output `x`, also fed by the state tensors a recompute produced. Its
    backward reads the seeds for those tensors (`seeds()`, at that moment) and queues `done` to run
    once this micro-batch's whole backward has finished (parameter gradients included)."""

    @staticmethod
    def forward(ctx, seeds, done, x, *produced):
        ctx.seeds, ctx.done, ctx.n = seeds, done, len(produced)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.done)
        return (None, None, grad, *(ctx.seeds() if ctx.n else ()))


def _loss(value: torch.Tensor, n_micro: int):
    """A last-stage loss in Megatron's (loss, num_tokens, reported) form that survives its division
    by the number of micro-batches unchanged."""
    return value * n_micro, torch.ones((), dtype=torch.int), {}


def _schedule(core, model, steps: list[Step], forward_step, forward_only: bool) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    pgs = core.pg_collection
    assert core.config.variable_seq_lengths, "pipeline replay needs variable_seq_lengths (models set it at pp > 1)"
    get_forward_backward_func(pp_size=pgs.pp.size())(
        forward_step_func=forward_step, data_iterator=iter(steps), model=[model], num_microbatches=len(steps),
        seq_length=1, micro_batch_size=1, forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=core.config), pg_collection=pgs)


def forward_once(model, forward, read):
    """One forward-only micro-batch through the pipeline (no autograd): `forward()` runs this stage's
    layers (its input arrives from the previous stage, its output goes to the next); on the last
    stage `read(output)` takes what it needs. Returns read's value on the last stage, None elsewhere."""
    core = E._core(model)
    box = []

    def forward_step(data_iterator, model_):
        next(data_iterator)
        out = forward()

        def loss(hidden):
            box.append(read(hidden))
            return _loss(hidden.new_zeros(()), 1)

        return out, loss

    _schedule(core, model, [None], forward_step, forward_only=True)
    return box[0] if box else None


def _capture(core, model, steps: list[Step], g, state: PromptState, layout: CPLayout | None) -> None:
    keep = g.cfg.mode == "exact"
    n = len(steps)

    def forward_step(data_iterator, model_):
        step = next(data_iterator)
        out = E.capture_chunk(core, state, step, g, layout, keep)
        return out, lambda _: _loss(out.new_zeros(()), n)

    _schedule(core, model, steps, forward_step, forward_only=True)
    state.finish_capture(layout)


def _replay_and_sweep(core, model, steps: list[Step], g, state: PromptState, layout: CPLayout | None) -> dict:
    """Replay micro-batches, then (exact mode) the chunks' recomputes, in one schedule; returns the
    branch results on the last stage (empty elsewhere)."""
    grad = g.loss_fn is not None
    device = next(core.parameters()).device
    n = len(steps)
    results: dict[int, E.BranchResult] = {}

    def step_done(chunk: int | None):
        def done():
            if chunk is not None:
                state.finish_chunk(chunk)
            E._micro_step_done(model)
        return done

    def forward_step(data_iterator, model_):
        step = next(data_iterator)
        if step.phase == "replay":
            ids, tgt = E.branch_batch(g, step.branches, device)
            with torch.set_grad_enabled(grad):
                out = core.forward_hidden(ids, E.replay_context(core, state, step, g, layout, grad))
                if grad:
                    out = _StageOutput.apply(None, step_done(None), out)

            def loss(hidden):
                with torch.set_grad_enabled(grad):
                    total, res = E.branch_losses(core, hidden, tgt, step, g)
                results.update(res)
                return _loss(total if grad else hidden.new_zeros(()), n)

            return out, loss
        assert step.phase == "prompt_backward", step.phase
        c = step.index
        with torch.enable_grad():
            hidden = core.forward_state(E._chunk_ids(g, step.span, layout), RecomputeContext(state, c, layout))
            x = hidden if hidden is not None else torch.zeros((), device=device)  # last stage: state only
            out = _StageOutput.apply(lambda: E.chunk_seeds(state, c, layout), step_done(c), x, *state.outputs(c))
        return out, lambda o: _loss(o, n)

    _schedule(core, model, steps, forward_step, forward_only=not grad)
    return results


def execute_stages(model, plan: list[Step], g, state: PromptState, state_grad: bool, layout: CPLayout | None):
    """`engine.execute` at pipeline size > 1: (results by branch on every rank, state, seconds per phase)."""
    core = E._core(model)
    seconds: dict[str, float] = {}
    capture = [s for s in plan if s.phase == "capture"]
    rest = [s for s in plan if s.phase != "capture"]
    assert plan[:len(capture)] == capture, "capture steps come first"
    if capture:
        t0 = time.perf_counter()
        _capture(core, model, capture, g, state, layout)
        seconds["capture"] = time.perf_counter() - t0
    results: dict = {}
    if rest:
        t0 = time.perf_counter()
        if state_grad:
            state.enable_grad()
        results = _replay_and_sweep(core, model, rest, g, state, layout)
        if any(s.phase == "prompt_backward" for s in rest):
            state.release_grad()  # the state gradient is spent
        seconds["replay"] = time.perf_counter() - t0  # replay and sweep interleave on a stage
        pp = core.pg_collection.pp
        box = [results]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
        results = box[0]
    return results, state, seconds
