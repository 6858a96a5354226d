"""The branch-replay schedule of one prompt group, as plain data.

`plan_group` is a pure function of the lengths and the mode; `replay/engine.py` executes the steps
in order with a small loop. For a prompt of P tokens the captured prefix is x[0:P-1] (the last
prompt token starts every branch). With P - 1 = 9 captured positions, capture chunks of 4 tokens,
three branches and exact mode:

    step  phase            index  span    branches
    0     capture          0      [0, 4)
    1     capture          1      [4, 8)
    2     capture          2      [8, 9)
    3     replay           0              (0,)       one micro-step per branch (or one with every
    4     replay           1              (1,)       branch when batched); each backward frees its
    5     replay           2              (2,)       graph before the next
    6     prompt_backward  2      [8, 9)             exact mode only: chunks from last to first,
    7     prompt_backward  1      [4, 8)             each recomputed with autograd and seeded with
    8     prompt_backward  0      [0, 4)             the state gradient accumulated so far

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
                   "segment", "segment_backward"]
    index: int                                  # capture chunk, replay micro-step, or prefix-tree node
    span: tuple[int, int] = (0, 0)              # prompt token range of a chunk; a segment's response depths
    # [a, b); (depth, 0) for a replay step: the response tokens its prefix-tree path covers (0: flat)
    branches: tuple[int, ...] = ()              # the branches of a replay micro-step (a segment: its members)


def chunk_spans(captured: int, chunk_len: int) -> list[tuple[int, int]]:
    if chunk_len < 1:
        raise ValueError(f"chunk_len={chunk_len}: must be >= 1")
    return [(s, min(captured, s + chunk_len)) for s in range(0, captured, chunk_len)]


def replay_steps(order: Sequence[int], batched: bool) -> list[Step]:
    if batched:
        return [Step("replay", 0, branches=tuple(order))] if order else []
    return [Step("replay", i, branches=(b,)) for i, b in enumerate(order)]


def plan_group(captured: int, chunk_len: int, order: Sequence[int], mode: str, batched: bool,
               replay: Sequence[Step] | None = None) -> list[Step]:
    """Capture `captured` prompt positions in chunks, replay the branches in `order` (or the given
    `replay` steps: a prefix tree's, replay/tree.py), and in exact mode sweep the chunks back from last
    to first."""
    if mode not in ("detached", "exact"):
        raise ValueError(f"mode={mode!r}: must be 'detached' or 'exact'")
    spans = chunk_spans(captured, chunk_len)
    steps = [Step("capture", c, span) for c, span in enumerate(spans)]
    steps += list(replay) if replay is not None else replay_steps(order, batched)
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
