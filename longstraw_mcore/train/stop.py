"""Stopping a run on a signal: what Slurm sends before a time limit or a preemption (`--signal`),
what `scancel` and torchrun send (SIGTERM).

`StopOnSignals(names)` installs handlers for those signals (train.stop_signals) that only set a flag;
the run reads it at safe points (replay/watch.py: before each step of a group's plan, agreed over the
ranks that run the plan together) and at the end of each step (train/trainer.py: one all-reduce over
every rank, with the step's metrics). A step left half-way is abandoned: its accumulated gradients are
dropped, no update is made, and the checkpoint written is of the last completed step, so the resumed
run redoes the abandoned step from the same weights, optimizer state and groups, bit-exactly. A
request that arrives after a step's last safe point finishes that step (update included) first.

`longstraw train` then exits with STOPPED_EXIT (75, sysexits' EX_TEMPFAIL: "try again"), which
launch/slurm.sbatch takes as "requeue me"; a second signal while the checkpoint is written changes
nothing (the flag is already set). The previous handlers come back on `close()`.
"""

from __future__ import annotations

import signal

STOPPED_EXIT = 75
"""The exit status of a run that stopped on a signal after saving its checkpoint (resume to continue)."""


class StopOnSignals:
    def __init__(self, names: str):
        self.requested = False
        self.signal_name: str | None = None
        self._old = {}
        for name in filter(None, (n.strip() for n in names.split(","))):
            sig = getattr(signal, name)
            self._old[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:  # (only a flag: a handler must not do collective work)
        if not self.requested:
            self.requested = True
            self.signal_name = signal.Signals(signum).name

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
