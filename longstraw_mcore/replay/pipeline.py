"""The replay plan through Megatron's pipeline engine, and the one place this package calls its schedule.

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

A prefix tree's steps (replay/tree.py) are micro-batches of the same schedule. A `segment` runs
forward on every stage and keeps its graph there (what the schedule sees is `_Cut`: the value, with
a graph reaching only the stage's received input, so the schedule's backward of it is empty); its
children follow; the `segment_backward` micro-batch's forward passes a zero tensor shaped like the
segment's stage output, and its backward (`_Bridge`) runs the kept graph once, seeded with the
gradient the next stage sent back, the children's deposits into the segment's leaves and (last
stage) the terminal responses' terms, and returns the segment's input gradient to the previous
stage. 1F1B keeps each stage's backwards in micro-batch order, so every child's has run by then;
since stage 0 forwards ahead of its backwards, a micro-batch's path is the segments live at its
forward (`live`), not at its backward.

Megatron divides each micro-batch's loss by the number of micro-batches; `_loss` hands it the loss
times that number so the gradient is the plain sum of the branches' terms, as at pp=1.

The state's transitions (replay/plan.py) run between the schedule calls, on every stage: after the
capture schedule (finish_capture: its seconds count as capture), before and after the replay schedule
(enable_grad, release_grad: counted as replay, with which the sweep interleaves).

`forward_once` is one forward-only micro-batch (sampling's decode step), `forward_backward` feeds
token batches through the stages with a loss on the logits (`longstraw smoke`); all three reach
Megatron's `get_forward_backward_func` through `schedule`.

Megatron's interleaved (virtual) stages (parallel.vpp > 1): a rank holds several model chunks (a list, or
models/chunks.py's ModelChunks / DDPChunks), and every schedule here runs Megatron's interleaved one: each
micro-batch through chunk 0 of every rank, then chunk 1, ..., `forward_step` told which chunk. The state is
the rank's, keyed by global layer number (the chunks' layers are disjoint): a capture chunk's bounds are
recorded once, each model chunk keeps its own path of live segments, and the sweep seeds and finishes a
chunk's outputs per model chunk (`PromptState.outputs(c, only=its layers)`); the reasoning above holds per
model chunk, whose forwards and backwards run in micro-batch order. Megatron takes the micro-batches pp at a
time and, measured on 0.19.2 at pp = 2, hangs when rank 0's warm-up holds all of them: idle micro-batches
fill both (replay/plan.py `interleaved_padding`, `_idle`). The bubble shrinks from (pp-1)/(M+pp-1) to
(pp-1)/(vpp M+pp-1) of a schedule of M micro-batches (planner/timing.py; measured: tools/bench_replay.py
--bubble).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from longstraw_mcore.models.chunks import chunk_list
from longstraw_mcore.parallel.cp import CPLayout
from longstraw_mcore.prompt_state.containers import PromptState
from longstraw_mcore.replay import steps as S
from longstraw_mcore.replay.plan import TRANSITIONS, Step, interleaved_padding


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


def schedule(model, pgs, config, data: list, forward_step, forward_only: bool, seq_length: int = 1,
             micro_batch_size: int = 1):
    """Megatron's schedule over the micro-batches `data` (no pipelining at pp = 1, 1F1B otherwise;
    explicit process groups); returns what it returns (the last stage's reported values). `model`: this
    rank's model, or its list of model chunks (parallel.vpp > 1): Megatron's interleaved schedule, each
    micro-batch through chunk 0 of every rank, then chunk 1, ..., `forward_step` called with the chunk
    (its `pre_process` / `post_process` say where it sits); it takes a multiple of pp micro-batches."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = chunk_list(model)
    vpp = len(chunks)
    data_iterator = iter(data) if vpp == 1 else [iter(data) for _ in chunks]
    kwargs = dict(forward_step_func=forward_step, data_iterator=data_iterator, model=chunks, num_microbatches=len(data),
                  seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only)
    if pgs.pp.size() > 1:  # explicit groups: Megatron wants the communicator and the collection together
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if vpp > 1:
            pp = pgs.pp.size()
            if interleaved_padding(len(data), pp, vpp, forward_only):  # (Megatron refuses a last group smaller
                # than pp, and hangs where rank 0 has no steady state: `interleaved_padding`)
                raise ValueError(f"{len(data)} micro-batches through {pp} pipeline ranks x {vpp} model chunks: the "
                                 f"interleaved schedule takes them {pp} at a time, so a multiple of {pp}"
                                 + ("" if forward_only else f", and more than {(2 * (pp - 1) + (vpp - 1) * pp) // vpp}"
                                                            " with a backward"))
            from longstraw_mcore.parallel import p2p_shapes

            p2p_shapes.install()  # (pp = 2: both directions' shapes to one peer; parallel/p2p_shapes.py)
        kwargs.update(p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config), pg_collection=pgs)
    return get_forward_backward_func(pp_size=pgs.pp.size(), vp_size=vpp if vpp > 1 else None)(**kwargs)


def _idle(core, n: int, forward_only: bool):
    """A micro-batch that only fills the interleaved schedule's last group of pp (Megatron takes them pp at a
    time): a [1, 1, Hd] zero hidden state (n Hd with n residual streams) through every stage unchanged, a zero loss
    (no gradient)."""
    if core.pre_process:
        width = core.config.hidden_size * core.model_cfg.residual_streams
        x = torch.zeros(1, 1, width, dtype=core.config.pipeline_dtype or core.config.params_dtype,
                        device=next(core.parameters()).device, requires_grad=not forward_only)
    else:
        x = core.decoder.input_tensor
    out = x.clone()
    return out, lambda o: _loss(o.sum() * 0, n)


def _replay_schedule(model, steps: list[Step], forward_step, forward_only: bool) -> None:
    """`steps` through Megatron's schedule: `forward_step(step, v, n)` runs step on this rank's model chunk v
    (0 at parallel.vpp = 1) of n micro-batches. With model chunks the steps are padded with idle
    micro-batches to a multiple of pp (`_idle`)."""
    chunks = chunk_list(model)
    cores = S.cores_of(model)
    core = cores[0]
    assert core.config.variable_seq_lengths, "pipeline replay needs variable_seq_lengths (models set it at pp > 1)"
    pad = interleaved_padding(len(steps), core.pg_collection.pp.size(), len(chunks), forward_only)
    steps = list(steps) + [Step("idle", i) for i in range(pad)]
    which = {id(m): v for v, m in enumerate(chunks)}

    def step_fn(data_iterator, model_):
        step, v = next(data_iterator), which[id(model_)]
        n = len(steps)  # (Megatron divides each loss by it: `_loss`)
        return _idle(cores[v], n, forward_only) if step.phase == "idle" else forward_step(step, v, n)

    schedule(model, core.pg_collection, core.config, steps, step_fn, forward_only)


def forward_once(model, forward, read):
    """One forward-only micro-batch through the pipeline (no autograd): `forward(core)` runs the layers of
    this stage's model chunk `core` (its input arrives from the previous stage, its output goes to the
    next); on the last stage `read(core, output)` takes what it needs. Returns read's value on the last
    stage, None elsewhere."""
    cores = S.cores_of(model)
    box = []

    def forward_step(step, v, n):
        core = cores[v]
        out = forward(core)

        def loss(hidden):
            box.append(read(core, hidden))
            return _loss(hidden.new_zeros(()), 1)

        return out, loss

    _replay_schedule(model, [Step("replay", 0)], forward_step, forward_only=True)
    return box[0] if box else None


def forward_backward(model, par, batches: list[torch.Tensor], loss_fn: Callable, forward_only: bool = False):
    """Each micro-batch of token ids through the stages (`longstraw smoke`; `model` may be a list of model
    chunks, `schedule`): `loss_fn` receives the
    vocab-parallel logits `[B, T, V/tp]` on the last stage and returns `(scalar loss, dict of float
    metrics)`; the schedule divides the loss by the number of micro-batches, as Megatron does. Returns,
    on every rank, the per-micro-batch values `loss_fn` reported."""
    if not batches:
        raise ValueError("forward_backward: no micro-batches")
    shape = tuple(batches[0].shape)
    if any(tuple(b.shape) != shape for b in batches):
        raise ValueError(f"micro-batches must share one shape [B, T]; got {[tuple(b.shape) for b in batches]}")

    def forward_step(data_iterator, model_):
        return model_(next(data_iterator).to(par.device)), loss_fn

    config = chunk_list(model)[0].config
    results = schedule(model, par.pgs, config, batches, forward_step, forward_only, seq_length=shape[1],
                       micro_batch_size=shape[0])
    if par.pp == 1:  # results live on the last stage; give every rank the same list
        return results
    box = [results if par.is_last_stage else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(par.pgs.pp, par.pp - 1), group=par.pgs.pp)
    return box[0]


def _capture(model, steps: list[Step], g, state: PromptState, layout: CPLayout | None) -> None:
    keep = g.cfg.mode == "exact"
    cores = S.cores_of(model)

    def forward_step(step, v, n):
        core = cores[v]
        out = S.capture_chunk(core, state, step, g, layout, keep)
        if g.watch is not None and core.pre_process:
            g.watch.done(step)
        out = out if out is not None else torch.zeros((), device=next(core.parameters()).device)  # last stage
        return out, lambda _: _loss(out.new_zeros(()), n)

    _replay_schedule(model, steps, forward_step, forward_only=True)


class _Cut(torch.autograd.Function):
    """A prefix-tree segment's stage output as the schedule sees it: its value (sent on), with a graph
    that reaches only `anchor` (the stage's received input, or a fresh leaf). The segment's real graph
    stays alive untouched: its backward is the segment_backward micro-batch's (`_Bridge`)."""

    @staticmethod
    def forward(ctx, anchor, value):
        ctx.anchor_shape = anchor.shape
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.anchor_shape), None


def _anchor(core, device) -> torch.Tensor:
    """The stage's received input (what Megatron collects the input gradient of), or a fresh leaf on
    the first stage."""
    x = None if core.pre_process else core.decoder.input_tensor
    return x if x is not None else torch.zeros((), device=device, requires_grad=True)


class _Bridge(torch.autograd.Function):
    """A segment_backward micro-batch on one stage: its forward passes a zero tensor shaped like the
    segment's stage output (so the gradient the next stage sends back has that shape); its backward runs
    the segment's kept graph on this stage once (reentrant), seeded with the gradient of the stage output
    (`grad`, from the next stage), what the children sent into the segment's leaves and, on the last
    stage, the terminal responses' loss terms; the input gradient it returns is the segment's."""

    @staticmethod
    def forward(ctx, run, done, anchor, like):
        ctx.run, ctx.done, ctx.anchor_shape = run, done, anchor.shape
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.done)
        g_in = ctx.run(grad)
        return None, None, g_in if g_in is not None else grad.new_zeros(ctx.anchor_shape), None


def _replay_and_sweep(model, steps: list[Step], g, state: PromptState, layout: CPLayout | None) -> dict:
    """Replay micro-batches (a prefix tree's segments among them), then (exact mode) the chunks'
    recomputes, in one schedule; returns the branch results on the last stage (empty elsewhere). Each of
    this rank's model chunks (parallel.vpp) runs every step on its layers: its own path of live segments,
    its own part of the sweep's seeds (the state is the rank's, keyed by layer)."""
    from longstraw_mcore.prompt_state.contexts import SegmentContext
    from longstraw_mcore.prompt_state.segments import SegmentPath

    grad = g.loss_fn is not None
    wrappers = chunk_list(model)
    cores = S.cores_of(model)
    layers = [list(c.state_kinds()) for c in cores]
    device = next(cores[0].parameters()).device
    results: dict[int, S.BranchResult] = {}
    live: list[list] = [[] for _ in cores]  # per chunk, the segments on the path of the micro-batch it forwards next

    def snapshot(v) -> SegmentPath:
        path = SegmentPath()
        path.stack = list(live[v])
        return path

    def step_done(v, chunk: int | None):
        def done():
            if chunk is not None:
                state.finish_chunk(chunk, layers[v])
            # (a holder of the whole rank's gradients, train/zero2.py, reduces what every chunk's backwards left)
            S.micro_step_done(model if hasattr(model, "micro_step_done") else wrappers[v])
        return done

    def segment(step, v, n):
        core = cores[v]
        ids, tgt, seg = S.segment_inputs(state, step, g, device)
        path = snapshot(v)
        with torch.set_grad_enabled(grad):
            seg.stage_input = None if core.pre_process else core.decoder.input_tensor
            out = core.forward_hidden(ids, SegmentContext(state, path, seg, layout))
        seg.seal(None, grad)
        seg.stage_output = out
        live[v].append(seg)
        # (detached: an edge into the kept graph would let this backward walk into it)
        sent = _Cut.apply(_anchor(core, device), out.detach()) if grad else out

        def loss(hidden):
            with torch.set_grad_enabled(grad):
                seg.set_logprobs(core.token_outputs(out, tgt, g.cfg.logprob_chunk)[0], grad)
            return _loss((hidden * 0).sum() if grad else hidden.new_zeros(()), n)

        return sent, loss

    def segment_backward(step, v, n):
        core = cores[v]
        path = snapshot(v)
        seg = live[v].pop()
        terminal = {}

        def run(grad_out):
            if terminal.get("loss") is not None:
                terminal["loss"].backward()  # the terminal responses' terms reach the path's log-prob leaves
            if seg.stage_input is not None:
                seg.stage_input.grad = None  # (the schedule's backward of the segment micro-batch left zeros)
            roots, seeds = seg.backward_roots()
            if not core.post_process:
                roots.append(seg.stage_output)
                seeds.append(grad_out)
            if roots:
                torch.autograd.backward(roots, seeds)
            return None if seg.stage_input is None else seg.stage_input.grad

        like = seg.stage_output.detach() if not core.post_process else torch.zeros((), device=device)
        out = _Bridge.apply(run, step_done(v, None), _anchor(core, device), like) if grad else like

        def loss(hidden):
            with torch.set_grad_enabled(grad):
                terminal["loss"], res = S.terminal_terms(g, path, step.branches)
            results.update(res)
            return _loss(hidden.sum() if grad else hidden.new_zeros(()), n)

        return out, loss

    def replay(step, v, n):
        core = cores[v]
        path = snapshot(v)
        ids, tgt = S.replay_inputs(g, step.branches, device, step.span[0])
        with torch.set_grad_enabled(grad):
            out = core.forward_hidden(ids, S.replay_context(core, state, step, g, layout, grad, path))
            if grad:
                out = _StageOutput.apply(None, step_done(v, None), out)

        def loss(hidden):
            with torch.set_grad_enabled(grad):
                total, res = S.branch_losses(core, hidden, tgt, step, g, path)
            results.update(res)
            return _loss(total if grad else hidden.new_zeros(()), n)

        return out, loss

    def prompt_backward(step, v, n):
        core, c, only = cores[v], step.index, layers[v]
        with torch.enable_grad():
            hidden = S.recompute_chunk(core, state, step, g, layout)
            x = hidden if hidden is not None else torch.zeros((), device=device)  # last stage: state only
            out = _StageOutput.apply(lambda: S.chunk_seeds(state, c, layout, only), step_done(v, c), x,
                                     *state.outputs(c, only))
        return out, lambda o: _loss(o, n)

    run = dict(segment=segment, segment_backward=segment_backward, replay=replay, prompt_backward=prompt_backward)

    def forward_step(step, v, n):
        if g.watch is not None and cores[v].pre_process:  # progress, counted at the first stage's forwards
            g.watch.done(step)
        return run[step.phase](step, v, n)

    _replay_schedule(model, steps, forward_step, forward_only=not grad)
    return results


def execute_pipeline(model, plan: list[Step], g, state: PromptState, layout: CPLayout | None):
    """`plan` (transitions included) at pipeline size > 1: consecutive capture steps as one forward-only
    schedule, consecutive replay / prompt-backward steps as one 1F1B schedule, transitions in between;
    returns (results by branch on every rank, state, seconds per phase)."""
    core = S.core_of(model)  # (a rank's model chunks: its first, for the process groups)
    seconds: dict[str, float] = {}
    results: dict = {}
    replayed = False
    i = 0
    while i < len(plan):
        t0 = time.perf_counter()
        step = plan[i]
        if step.phase in TRANSITIONS:
            S.transition(state, step, layout)
            phase, i = ("capture" if step.phase == "finish_capture" else "replay"), i + 1
        else:
            if g.watch is not None:
                g.watch.before(step)  # the safe point before a schedule (none inside one)
            work = ("capture",) if step.phase == "capture" else ("replay", "prompt_backward", "segment",
                                                                  "segment_backward")
            j = i
            while j < len(plan) and plan[j].phase in work:
                j += 1
            if step.phase == "capture":
                _capture(model, plan[i:j], g, state, layout)
                phase = "capture"
            else:
                results.update(_replay_and_sweep(model, plan[i:j], g, state, layout))
                phase, replayed = "replay", True  # replay and sweep interleave on a stage
            i = j
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
    if replayed:
        pp = core.pg_collection.pp
        box = [results]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
        results = box[0]
    return results, state, seconds
