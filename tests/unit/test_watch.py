"""replay/watch.py on a plan written out by hand (no model, no process group): the phases' token totals
(capture and the sweep: prompt positions; replay: the response tokens a step runs from its depth), a
line per step at progress_every_s=0 with done/total, tokens/s and the ETA, nothing for a group shorter
than the interval; a stop request raises Stopped at the next safe point (one rank: no agreement needed)."""

from __future__ import annotations

import pytest

from longstraw_mcore.replay.plan import Step
from longstraw_mcore.replay.watch import Stopped, Watch

PLAN = [Step("capture", 0, (0, 64)), Step("capture", 1, (64, 99)), Step("finish_capture", 0),
        Step("replay", 0, (0, 0), (0,)), Step("replay", 1, (2, 0), (1, 2)),
        Step("prompt_backward", 1, (64, 99)), Step("prompt_backward", 0, (0, 64))]
RESPONSES = [[1] * 5, [1] * 7, [1] * 4]


def _run(watch):
    watch.label = "group 7 "
    watch.begin(PLAN, RESPONSES)
    for st in PLAN:
        watch.before(st)
        watch.done(st)


def test_totals_lines_and_quiet_short_groups():
    lines = []
    w = Watch(lines.append, every_s=0.0)
    _run(w)
    assert w.totals == {"capture": 99, "replay": 5 + (7 - 2) + (4 - 2), "prompt backward": 99}
    assert lines[0].startswith("[progress] group 7 capture: 64 / 99 tokens (65%), ") and "ETA" in lines[0]
    assert lines[1].startswith("[progress] group 7 capture: 99 / 99 tokens (100%), ") and "done in" in lines[1]
    assert [ln.split(":")[0] for ln in lines] == ["[progress] group 7 capture"] * 2 + \
        ["[progress] group 7 replay"] * 2 + ["[progress] group 7 prompt backward"] * 2
    quiet = []
    _run(Watch(quiet.append, every_s=3600.0))
    assert quiet == []


def test_a_stop_request_raises_at_the_next_safe_point():
    class Flag:
        requested = False

    flag = Flag()
    w = Watch(None, stop=flag)
    w.begin(PLAN, RESPONSES)
    w.before(PLAN[0])  # nothing requested: passes
    flag.requested = True
    with pytest.raises(Stopped):
        w.before(PLAN[1])
