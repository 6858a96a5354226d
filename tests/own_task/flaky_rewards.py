"""Reward functions that fail on purpose (tests/dist/test_own_task.py): the run must go on, counting them."""

import math
import time


def raises(responses, row):
    raise RuntimeError(f"this reward always raises (row keys {sorted(row)})")


def hangs(responses, row):
    time.sleep(600)
    return [0.0] * len(responses)


def nan(responses, row):
    return [math.nan] * len(responses)


def wrong_count(responses, row):
    return [1.0]


def length(responses, row, token_ids):
    """A reward that varies (so groups have an advantage): longer responses score more."""
    return [len(t) / 8.0 for t in token_ids]
