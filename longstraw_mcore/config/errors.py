"""The error every bad config value raises, and the checks the config classes share.

Every message names the offending key and value and what would be valid. Choice fields are typed
`Literal[...]` and checked from that annotation (`check_choices`), so a list of choices is spelled
once, in the type."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, Literal, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it and what would be valid."""


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {list(choices)}")


@cache
def _literal_fields(cls) -> tuple[tuple[str, tuple], ...]:
    hints = get_type_hints(cls)
    return tuple((f.name, get_args(hints[f.name])) for f in dataclasses.fields(cls)
                 if get_origin(hints[f.name]) is Literal)


def check_choices(obj, section: str) -> None:
    """Every `Literal`-typed field of the dataclass `obj` holds one of its choices (`section.field=...`)."""
    for name, choices in _literal_fields(type(obj)):
        check_choice(f"{section}.{name}" if section else name, getattr(obj, name), choices)


def check_ints(obj, section: str, names, low: int = 1, words: str = "a positive integer") -> None:
    """Each named field is an int (not a bool) >= `low`."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ConfigError(f"{section}.{name}={v!r}: must be {words}")
