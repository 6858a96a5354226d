"""A prompt group's progress, and the safe points where a run may stop.

The executors call `Watch.before(step)` before each step of a group's plan and `Watch.done(step)` after
it (replay/local.py). Under pipeline parallelism (replay/pipeline.py) the safe points are between its
schedule calls, as Megatron's schedule cannot be left half-way, and the progress is counted per
micro-batch on the first stage.

Progress: tokens done of the phase's total (capture: the prompt positions; replay: the response
tokens the replay steps run; exact mode's sweep: the prompt positions again), tokens/s over the phase
so far and the ETA, printed by rank 0 at most every `every_s` seconds of wall time, and when a phase
ends after having printed (a long capture is hours at 2M tokens; a short group prints nothing).

Stopping: a stop request (train/stop.py: a signal) is a rank's own flag, but a rank may leave a plan
only together with every rank it shares a collective with inside a step, so `safe_point()` first
agrees over the lockstep group (parallel/groups.lockstep_group: one max all-reduce of the flag) and
raises `Stopped` on all of them or on none. Ranks outside the group (data parallel without EP) run
other prompt groups and learn at the step's end (train/trainer.py).
"""

from __future__ import annotations

import time

from longstraw_mcore.parallel.reduce import all_reduce_max


class Stopped(Exception):
    """Every rank of the lockstep group agreed, at a safe point, to leave the group's plan."""


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


_PHASE = {"capture": "capture", "replay": "replay", "segment": "replay", "prompt_backward": "prompt backward"}


class Watch:
    """Progress printing (`log` on rank 0; None: silent) and stop agreement (`stop`: an object with a
    `requested` bool; `group`: the lockstep process group; `device`: where the agreement's tensor lives)."""

    def __init__(self, log=None, every_s: float = 10.0, stop=None, group=None, device=None):
        self.log, self.every_s, self.stop, self.group, self.device = log, every_s, stop, group, device
        self.label, self.totals, self.done_tokens = "", {}, {}
        self.started: dict[str, float] = {}
        self.last_print = 0.0
        self.printed: set[str] = set()
        self.responses: list[list[int]] = []
        self.last_event = time.monotonic()

    def begin(self, plan, responses: list[list[int]]) -> None:
        """A new plan of the group `label` names (process_group sets it): its phases' token totals."""
        self.responses = responses
        self.totals, self.done_tokens, self.started, self.printed = {}, {}, {}, set()
        self.last_print = self.last_event = time.monotonic()  # (a group shorter than every_s prints nothing)
        for st in plan:
            phase = _PHASE.get(st.phase)
            if phase is not None:
                self.totals[phase] = self.totals.get(phase, 0) + self.tokens(st)

    def tokens(self, st) -> int:
        if st.phase in ("capture", "prompt_backward"):
            return st.span[1] - st.span[0]
        if st.phase == "segment":
            return st.span[1] - st.span[0]
        if st.phase == "replay":
            return sum(len(self.responses[b]) - st.span[0] for b in st.branches)
        return 0

    def before(self, st) -> None:
        """Before a step of the plan: the phase's clock starts; then the safe point."""
        phase = _PHASE.get(st.phase)
        self.last_event = time.monotonic()
        if phase is not None:
            self.started.setdefault(phase, self.last_event)
        self.safe_point()

    def safe_point(self) -> None:
        """Raise Stopped on every rank of the lockstep group if any of them was asked to stop."""
        if self.stop is None:
            return
        mine = 1.0 if self.stop.requested else 0.0
        if self.group is not None:
            mine = all_reduce_max([mine], self.group, self.device)[0]
        if mine > 0:
            self.stop.requested = True  # a peer's request is this rank's too (the step's end agrees on it)
            raise Stopped()

    def done(self, st) -> None:
        phase = _PHASE.get(st.phase)
        if phase is None or self.log is None:
            self.last_event = time.monotonic()
            return
        now = time.monotonic()
        self.started.setdefault(phase, self.last_event)  # (a phase begun inside a schedule: at the last event)
        self.last_event = now
        self.done_tokens[phase] = self.done_tokens.get(phase, 0) + self.tokens(st)
        finished = self.done_tokens[phase] >= self.totals.get(phase, 0)
        if now - self.last_print >= self.every_s or (finished and phase in self.printed):
            self.last_print = now
            self.printed.add(phase)
            self.log(self.line(phase, now))

    def line(self, phase: str, now: float) -> str:
        done, total = self.done_tokens[phase], max(self.totals.get(phase, 0), 1)
        took = max(now - self.started[phase], 1e-9)
        rate = done / took
        eta = (total - done) / rate if rate > 0 else float("inf")
        return (f"[progress] {self.label}{phase}: {done:,} / {total:,} tokens ({100 * done / total:.0f}%), "
                f"{rate:,.0f} tokens/s, {'done in ' + _clock(took) if done >= total else 'ETA ' + _clock(eta)}")
