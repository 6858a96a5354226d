"""The replay schedule is plain data: `plan_group` for the docstring's example, detached mode,
batched branches, a one-token prompt (nothing to capture, no prompt backward) and bad input."""

from __future__ import annotations

import pytest

from longstraw_mcore.replay.plan import Step, plan_group


def test_exact_plan_matches_the_documented_timeline():
    plan = plan_group(9, 4, [0, 1, 2], "exact", batched=False)
    assert plan == [Step("capture", 0, (0, 4)), Step("capture", 1, (4, 8)), Step("capture", 2, (8, 9)),
                    Step("replay", 0, branches=(0,)), Step("replay", 1, branches=(1,)),
                    Step("replay", 2, branches=(2,)),
                    Step("prompt_backward", 2, (8, 9)), Step("prompt_backward", 1, (4, 8)),
                    Step("prompt_backward", 0, (0, 4))]


def test_detached_batched_and_empty_prompt():
    plan = plan_group(8, 8, [2, 0, 1], "detached", batched=True)
    assert plan == [Step("capture", 0, (0, 8)), Step("replay", 0, branches=(2, 0, 1))]
    assert plan_group(0, 4, [0, 1], "exact", batched=False) == [Step("replay", 0, branches=(0,)),
                                                                Step("replay", 1, branches=(1,))]
    with pytest.raises(ValueError, match="mode='truncated'"):
        plan_group(4, 2, [0], "truncated", batched=False)
    with pytest.raises(ValueError, match="chunk_len=0"):
        plan_group(4, 0, [0], "exact", batched=False)
