"""The replay schedule is plain data: `plan_group` for the docstring's example, detached mode, a
one-token prompt (nothing to capture, no prompt backward) and bad input; the replay micro-steps under
a token budget (`micro_steps`, `replay_steps`, and a prefix tree's tails in `tree_steps`)."""

from __future__ import annotations

import pytest

from longstraw_mcore.replay.plan import Step, micro_steps, plan_group, replay_steps
from longstraw_mcore.replay.tree import build_tree, tree_steps


def test_exact_plan_matches_the_documented_timeline():
    plan = plan_group(9, 4, replay_steps([0, 1, 2], [3, 3, 3], 0), "exact")
    assert plan == [Step("capture", 0, (0, 4)), Step("capture", 1, (4, 8)), Step("capture", 2, (8, 9)),
                    Step("replay", 0, branches=(0,)), Step("replay", 1, branches=(1,)),
                    Step("replay", 2, branches=(2,)),
                    Step("prompt_backward", 2, (8, 9)), Step("prompt_backward", 1, (4, 8)),
                    Step("prompt_backward", 0, (0, 4))]


def test_detached_batched_and_empty_prompt():
    plan = plan_group(8, 8, replay_steps([2, 0, 1], [4, 4, 4], 12), "detached")
    assert plan == [Step("capture", 0, (0, 8)), Step("replay", 0, branches=(2, 0, 1))]
    assert plan_group(0, 4, replay_steps([0, 1], [2, 2], 0), "exact") == [Step("replay", 0, branches=(0,)),
                                                                          Step("replay", 1, branches=(1,))]
    with pytest.raises(ValueError, match="mode='truncated'"):
        plan_group(4, 2, [], "truncated")
    with pytest.raises(ValueError, match="chunk_len=0"):
        plan_group(4, 0, [], "exact")


def test_micro_steps_fill_the_budget_in_order():
    """Consecutive runs, each as long as (branches x its longest) fits; the docstring's example."""
    assert micro_steps([5, 1, 9, 3], 12) == [(0, 2), (2, 3), (3, 4)]
    # boundaries: exactly the budget fits, one token over does not
    assert micro_steps([4, 4, 4], 12) == [(0, 3)]
    assert micro_steps([4, 4, 4], 11) == [(0, 2), (2, 3)]
    # the padded batch counts the longest branch, wherever it sits in the run
    assert micro_steps([1, 1, 6], 12) == [(0, 2), (2, 3)]          # 3 x 6 = 18 > 12
    assert micro_steps([6, 1, 1], 18) == [(0, 3)]                  # 3 x 6 = 18
    # a branch longer than the budget runs alone, and the next run starts after it
    assert micro_steps([2, 20, 2, 2], 8) == [(0, 1), (1, 2), (2, 4)]
    assert micro_steps([20], 8) == [(0, 1)]
    # 0: one branch per micro-step (today's unbatched); a budget of every branch: one step
    assert micro_steps([3, 1, 2], 0) == [(0, 1), (1, 2), (2, 3)]
    assert micro_steps([3, 1, 2], 9) == [(0, 3)]
    assert micro_steps([], 100) == []
    # runs of different sizes (2, 3, 1) and lengths
    assert micro_steps([3, 1, 7, 2, 6, 1, 4, 8], 24) == [(0, 3), (3, 7), (7, 8)]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"budget={bad!r}: must be an integer >= 0"):
            micro_steps([1], bad)
    with pytest.raises(ValueError, match="every branch replays at least one token"):
        micro_steps([2, 0], 4)


def test_replay_steps_keep_the_order_and_cut_by_each_branch_length():
    lengths = [5, 1, 9, 3]                      # by branch id
    assert replay_steps([3, 1, 0, 2], lengths, 15) == [Step("replay", 0, branches=(3, 1, 0)),   # 3 x 5
                                                       Step("replay", 1, branches=(2,))]
    assert replay_steps([0, 1, 2, 3], lengths, 12) == [Step("replay", 0, branches=(0, 1)),
                                                       Step("replay", 1, branches=(2,)),
                                                       Step("replay", 2, branches=(3,))]
    # below a prefix-tree node at depth 2: tails of 3, 7, 1 tokens; indices from `first`
    assert replay_steps([0, 2, 3], lengths, 14, first=4, depth=2) == [Step("replay", 4, (2, 0), (0, 2)),  # 2 x 7
                                                                      Step("replay", 5, (2, 0), (3,))]


def test_tree_steps_group_each_nodes_tails_by_their_own_tokens():
    """The tails of one node share micro-steps by the tokens they replay below it; tails of different
    nodes never share one (they start at different depths)."""
    a = [7, 7]
    responses = [a + [1, 1, 1], a + [2], a + [3, 3, 3, 3, 3, 3], a + [4, 4], [9, 9, 9], [8]]
    lengths = [len(r) for r in responses]
    root = build_tree(responses)

    def shape(budget):
        return [(s.phase, s.span, s.branches) for s in tree_steps(root, lengths, budget)]

    seg = ("segment", (0, 2), (0, 1, 2, 3))
    back = ("segment_backward", (0, 2), ())
    # tails below [7 7]: 3, 1, 6, 2 tokens; the root's: 3, 1
    assert shape(0) == [seg, ("replay", (2, 0), (0,)), ("replay", (2, 0), (1,)), ("replay", (2, 0), (2,)),
                        ("replay", (2, 0), (3,)), back, ("replay", (0, 0), (4,)), ("replay", (0, 0), (5,))]
    assert shape(6) == [seg, ("replay", (2, 0), (0, 1)), ("replay", (2, 0), (2,)), ("replay", (2, 0), (3,)),
                        back, ("replay", (0, 0), (4, 5))]
    assert shape(100) == [seg, ("replay", (2, 0), (0, 1, 2, 3)), back, ("replay", (0, 0), (4, 5))]
    steps = tree_steps(root, lengths, 6)
    assert [s.index for s in steps] == [1, 1, 2, 3, 1, 5]  # segment: its node; replay: its place in the list
