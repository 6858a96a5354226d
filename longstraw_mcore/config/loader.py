"""YAML files and `key=value` overrides -> the typed configs.

`load_config(path, overrides)` reads a YAML file (`configs/*.yaml`), applies `a.b=value` overrides
(values parsed as YAML) and builds `RunConfig`; the model section's `family` key picks its dataclass
(qwen3_5 when absent). Unknown keys and values of the wrong type are refused naming the key and what
would be valid (a removed key names its replacement: REMOVED); each dataclass then checks its own
values."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import yaml

from longstraw_mcore.config.errors import ConfigError, check_choice
from longstraw_mcore.config.run import MODEL_CONFIGS, ModelConfig, RunConfig
from longstraw_mcore.config.sections import BATCH_TOKENS


REMOVED = {
    "replay.batch_branches": "replay.batch_tokens, a token budget per replay micro-step: replay.batch_tokens=0 "
                             "is batch_branches=false (one branch per micro-step), a budget of at least G x R "
                             "tokens is batch_branches=true (the default batches up to "
                             f"{BATCH_TOKENS} tokens)",
}
"""Config keys that no longer exist: {key: what replaced it}. No alias: a config naming one is refused."""


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """The dataclass's resolved field types (resolving string annotations costs more than the rest of a
    load; `plan --suggest` loads thousands of candidate configs)."""
    return get_type_hints(cls)


def _dataclass_from_dict(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = _hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        prefix = f"{where}." if where else ""
        for k in unknown:
            if prefix + k in REMOVED:
                raise ConfigError(f"config key {prefix + k} was removed; use {REMOVED[prefix + k]}")
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys under "
                          f"{where or 'the top level'}: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        typ = hints[name]
        path = f"{where}.{name}" if where else name
        if typ == ModelConfig:
            kwargs[name] = model_config_from_dict(value, path)
        elif dataclasses.is_dataclass(typ):
            kwargs[name] = _dataclass_from_dict(typ, value, path)
        else:
            kwargs[name] = _coerce(typ, value, path)
    missing = [f.name for f in fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"missing required config key(s): {[prefix + k for k in missing]}")
    return cls(**kwargs)


def _coerce(typ, value, path: str):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{path}={value!r}: expected a number") from None
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if typ in (int, float, str, bool) and not isinstance(value, typ):
        raise ConfigError(f"{path}={value!r}: expected {typ.__name__}")
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (value parsed as YAML) to a nested dict, copying it."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. parallel.tp=2")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> RunConfig:
    """Load `RunConfig` from a YAML file (or `base` dict), then apply `key=value` overrides."""
    data: dict = {}
    if base is not None:
        data = base
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        data = _deep_merge(data, loaded)
    data = apply_overrides(data, list(overrides))
    return _dataclass_from_dict(RunConfig, data, "")


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def model_config_from_dict(d: dict, where: str = "model") -> ModelConfig:
    """The family's model config (`family` picks it; qwen3_5 when absent)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    family = d.get("family", "qwen3_5")
    check_choice(f"{where}.family", family, tuple(MODEL_CONFIGS))
    return _dataclass_from_dict(MODEL_CONFIGS[family], d, where)
