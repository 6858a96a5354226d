"""The planner's one memo: counts a search asks for again and again (`plan --suggest` plans thousands of
switch settings on a few layouts of one model), kept by a key that names everything they depend on
(its first item names the count). Bounded: cleared when it grows past LIMIT entries."""

from __future__ import annotations

from typing import Callable

LIMIT = 1024
_KEPT: dict[tuple, object] = {}


def kept(key: tuple, compute: Callable[[], object]):
    """compute(), or what it returned before for `key`."""
    if key not in _KEPT:
        if len(_KEPT) > LIMIT:
            _KEPT.clear()
        _KEPT[key] = compute()
    return _KEPT[key]
