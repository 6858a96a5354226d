"""The branch-replay schedule of one prompt group, as plain data.

`plan_group` is a pure function of the lengths and the mode; `replay/engine.py` executes the steps
in order with a small loop. For a prompt of P tokens the captured prefix is x[0:P-1] (the last
prompt token starts every branch). With P - 1 = 9 captured positions, capture chunks of 4 tokens,
three branches and exact mode:

    step  phase            index  span    branches
    0     capture          0      [0, 4)
    1     capture          1      [4, 8)
    2     capture          2      [8, 9)
    3     replay           0              (0,)       micro-steps of the branches (here one branch
    4     replay           1              (1,)       each: replay.batch_tokens=0); each backward
    5     replay           2              (2,)       frees its graph before the next
    6     prompt_backward  2      [8, 9)             exact mode only: chunks from last to first,
    7     prompt_backward  1      [4, 8)             each recomputed with autograd and seeded with
    8     prompt_backward  0      [0, 4)             the state gradient accumulated so far

Replay micro-steps (`micro_steps`): the branches, in replay order, are cut into consecutive runs, each
as long as its right-padded batch (branches x the longest one's tokens) fits `replay.batch_tokens`; a
branch longer than the budget runs alone, and a budget of 0 gives one branch per micro-step. With
branches of 5, 1, 9, 3 tokens and a budget of 12: (0, 1) [2 x 5 = 10], (2,) [9; 2 x 9 > 12], (3,).
The planner counts the same micro-steps (planner/memory.py, planner/timing.py, and the padded
positions in planner/flops.py `padded_steps`).

With shared response prefixes the replay steps are a prefix tree's (replay/tree.py: `segment`,
`replay` from a depth, `segment_backward`, depth first); the rest of the plan is unchanged.
Detached mode stops after the replay steps; scoring (no autograd) is a plan of replay steps alone
against a state captured before. Each pipeline stage runs the same steps on its own layers (nothing
in a step depends on which layers execute it): replay/pipeline.py feeds them to Megatron's pipeline
engine as micro-batches, replay/local.py runs them in a loop at pp = 1.

The prompt state's lifecycle transitions are steps too (`with_transitions`), so the executors only
dispatch: `finish_capture` after the last capture chunk (context parallelism gathers the final
recurrent state there), `enable_grad` before the first replay step of exact mode (the state gradient
starts accumulating), `release_grad` after the last chunk of the prompt backward (it is spent). The
example above, exact, becomes

    capture 0, capture 1, capture 2, finish_capture, enable_grad, replay 0, replay 1, replay 2,
    prompt_backward 2, prompt_backward 1, prompt_backward 0, release_grad
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence


TRANSITIONS = ("finish_capture", "enable_grad", "release_grad")
"""The state's lifecycle steps (no model work)."""


@dataclass(frozen=True)
class Step:
    phase: Literal["capture", "replay", "prompt_backward", "finish_capture", "enable_grad", "release_grad",
                   "segment", "segment_backward", "idle"]  # idle: a pipeline's filler (replay/pipeline.py)
    index: int                                  # capture chunk, replay micro-step, or prefix-tree node
    span: tuple[int, int] = (0, 0)              # prompt token range of a chunk; a segment's response depths
    # [a, b); (depth, 0) for a replay step: the response tokens its prefix-tree path covers (0: flat)
    branches: tuple[int, ...] = ()              # the branches of a replay micro-step (a segment: its members)


def chunk_spans(captured: int, chunk_len: int) -> list[tuple[int, int]]:
    if chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len}: must be >= 1")
    return [(s, min(captured, s + chunk_len)) for s in range(0, captured, chunk_len)]


def micro_steps(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """The replay micro-steps of branches of `lengths` tokens (in replay order) under a token budget:
    consecutive [start, stop) index ranges, each taking branches while its right-padded batch,
    (stop - start) x max(lengths[start:stop]), stays <= `budget`; a branch longer than the budget
    alone; `budget` 0: one branch each. Greedy in order, so the grouping is a plain function of the
    lengths (the executor's and the planner's)."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(f"budget={budget!r}: must be an integer >= 0 (tokens; 0 = one branch per micro-step)")
    if any(n < 1 for n in lengths):
        raise ValueError(f"lengths={list(lengths)}: every branch replays at least one token")
    out: list[tuple[int, int]] = []
    start, widest = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i + 1 - start) * max(widest, n) > budget:
            out.append((start, i))
            start, widest = i, 0
        widest = max(widest, n)
    if len(lengths):
        out.append((start, len(lengths)))
    return out


def even_micro_steps(tokens: int, branches: int, budget: int) -> tuple[int, int]:
    """(micro-steps, branches in the widest) of `branches` branches of `tokens` each under `budget`:
    `micro_steps` of equal lengths, the planner's case (planner/memory.py, planner/timing.py)."""
    runs = micro_steps([tokens] * branches, budget)
    return len(runs), max((b - a for a, b in runs), default=0)


def replay_steps(order: Sequence[int], lengths: Sequence[int], budget: int, first: int = 0,
                 depth: int = 0) -> list[Step]:
    """The replay micro-steps of the branches in `order` (`lengths[b]`: branch b's response tokens; a
    step from `depth` replays lengths[b] - depth of them), grouped by `micro_steps` under `budget`;
    indices count from `first`."""
    runs = micro_steps([lengths[b] - depth for b in order], budget)
    span = (depth, 0)
    return [Step("replay", first + i, span, tuple(order[a:b])) for i, (a, b) in enumerate(runs)]


def plan_group(captured: int, chunk_len: int, replay: Sequence[Step], mode: str) -> list[Step]:
    """Capture `captured` prompt positions in chunks, run the `replay` steps (`replay_steps`, or a
    prefix tree's: replay/tree.py), and in exact mode sweep the chunks back from last to first."""
    if mode not in ("detached", "exact"):
        raise ValueError(f"mode={mode!r}: must be 'detached' or 'exact'")
    spans = chunk_spans(captured, chunk_len)
    steps = [Step("capture", c, span) for c, span in enumerate(spans)]
    steps += list(replay)
    if mode == "exact":
        steps += [Step("prompt_backward", c, spans[c]) for c in reversed(range(len(spans)))]
    return steps


def with_transitions(plan: Sequence[Step], state_grad: bool) -> list[Step]:
    """`plan`'s steps with the state's lifecycle transitions where they happen (see the module
    docstring); `state_grad`: exact mode with a loss, the state gradient accumulates over the replays."""
    out: list[Step] = []
    for i, step in enumerate(plan):
        if step.phase in ("replay", "segment") and state_grad:
            out.append(Step("enable_grad", 0))
            state_grad = False
        out.append(step)
        if step.phase == "capture" and (i + 1 == len(plan) or plan[i + 1].phase != "capture"):
            out.append(Step("finish_capture", 0))
        elif step.phase == "prompt_backward" and step.index == 0:
            out.append(Step("release_grad", 0))
    return out


def interleaved_padding(n: int, pp: int, vpp: int, forward_only: bool) -> int:
    """Idle micro-batches that fill `n` for Megatron's interleaved schedule (none at vpp = 1): up to a multiple
    of pp (it takes them pp at a time), and with a backward beyond its warm-up on every rank, 2 (pp - 1) +
    (vpp - 1) pp chunk forwards on rank 0 (measured on Megatron-Core 0.19.2, gloo, pp = 2 x vpp = 2: two
    micro-batches, all warm-up on rank 0, left the ranks waiting on each other's p2p forever)."""
    if vpp == 1:
        return 0
    need = n if forward_only else max(n, (2 * (pp - 1) + (vpp - 1) * pp) // vpp + 1)
    return -(-need // pp) * pp - n
