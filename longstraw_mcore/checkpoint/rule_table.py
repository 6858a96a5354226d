"""One mapping table, both directions: Hugging Face tensors <-> canonical Megatron tensors.

A family lists `Rule`s: a tuple of HF names, a tuple of canonical Megatron names (the keys of
`model.sharded_state_dict()`: TP/EP-independent, global layer numbers, full tensors) and a named
transform with its row sizes. `hf_to_mcore` and `mcore_to_hf` read the same table, and every transform
is only views, cat, split and stack (no casts), so a round trip is bit-exact by construction.

    transform      HF -> Megatron                                   sizes
    identity       x -> x                                           -
    concat_rows    (a, b, ...) -> cat rows                          rows of each HF piece
    split_rows     x -> (rows [0, n0), [n0, n0 + n1), ...)          rows of each Megatron piece
    split_conv     conv1d [C, 1, W] -> split_rows of [C, W]         rows of each Megatron piece
    stack_concat   per expert e: (a_e, b_e, ...) -> [E, sum rows, ...]  rows of one expert's HF pieces
                   (Megatron's SequentialMLP checkpoints its experts stacked on a leading expert axis;
                   sizes (n,) is a plain stack)

`LazyCanonical` computes canonical tensors on access one rule at a time, and `read(key, slices)` maps
a slice of a canonical tensor to slices of the HF tensors, so a TP/EP rank reads only its shard from
safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from longstraw_mcore.checkpoint.common import CheckpointError, shape_of


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]
    mcore: tuple[str, ...]
    transform: str
    sizes: tuple[int, ...] = ()


def forward(r: Rule, xs: list) -> list:
    """HF tensors of the rule -> its Megatron tensors."""
    t = r.transform
    if t == "identity":
        return list(xs)
    if t == "concat_rows":
        return [torch.cat(xs, dim=0)]
    if t == "split_rows":
        return list(torch.split(xs[0], list(r.sizes), dim=0))
    if t == "split_conv":
        return [p.squeeze(1) for p in torch.split(xs[0], list(r.sizes), dim=0)]
    if t == "stack_concat":
        g = len(r.sizes)
        return [torch.stack([torch.cat(xs[e:e + g], dim=0) for e in range(0, len(xs), g)])]
    raise KeyError(t)


def inverse(r: Rule, xs: list) -> list:
    """Megatron tensors of the rule -> its HF tensors (in `r.hf` order)."""
    t = r.transform
    if t == "identity":
        return list(xs)
    if t == "concat_rows":
        return list(torch.split(xs[0], list(r.sizes), dim=0))
    if t == "split_rows":
        return [torch.cat(xs, dim=0)]
    if t == "split_conv":
        return [torch.cat([p.unsqueeze(1) for p in xs], dim=0)]
    if t == "stack_concat":
        return [p for expert in xs[0].unbind(0) for p in torch.split(expert, list(r.sizes), dim=0)]
    raise KeyError(t)


def _hf_read(hf: Mapping, name: str, sl: tuple[slice, ...]) -> torch.Tensor:
    return hf.read(name, sl) if hasattr(hf, "read") else hf[name][sl]


def _read_concat(hf: Mapping, names, rows: slice, rest: tuple) -> torch.Tensor:
    """Rows `rows` of cat(names) read from the pieces that hold them."""
    parts, start = [], 0
    for name in names:
        n = shape_of(hf, name)[0]
        a, b = max(rows.start, start), min(rows.stop, start + n)
        if a < b:
            parts.append(_hf_read(hf, name, (slice(a - start, b - start),) + rest))
        start += n
    return torch.cat(parts, 0)


def read(r: Rule, key: str, hf: Mapping, sl: tuple[slice, ...]) -> torch.Tensor:
    """`forward(r, hf)[key][sl]`, reading only what the slice needs."""
    t, j = r.transform, r.mcore.index(key)
    rows, rest = sl[0], tuple(sl[1:])
    if t == "identity":
        return _hf_read(hf, r.hf[j], sl)
    if t in ("split_rows", "split_conv"):  # Megatron piece j = HF rows [off_j, off_j + n_j)
        off = sum(r.sizes[:j])
        hf_rows = slice(off + rows.start, off + rows.stop)
        if t == "split_rows":
            return _hf_read(hf, r.hf[0], (hf_rows,) + rest)
        return _hf_read(hf, r.hf[0], (hf_rows, slice(0, 1)) + rest).squeeze(1)
    if t == "concat_rows":
        return _read_concat(hf, r.hf, rows, rest)
    if t == "stack_concat":  # rows = experts: each expert's pieces, only the rows/columns asked for
        g = len(r.sizes)
        return torch.stack([_read_concat(hf, r.hf[e * g:(e + 1) * g], rest[0], rest[1:])
                            for e in range(rows.start, rows.stop)])
    raise KeyError(t)


def shape(r: Rule, key: str, hf: Mapping) -> tuple[int, ...]:
    t = r.transform
    shapes = [shape_of(hf, k) for k in r.hf]
    if t == "identity":
        return shapes[r.mcore.index(key)]
    if t == "concat_rows":
        return (sum(s[0] for s in shapes),) + shapes[0][1:]
    if t == "stack_concat":
        return (len(shapes) // len(r.sizes), sum(r.sizes)) + shapes[0][1:]
    rows = r.sizes[r.mcore.index(key)]
    return (rows,) + (shapes[0][1:] if t == "split_rows" else shapes[0][2:])


def check_hf_tensors(tensors: Mapping, expected: dict[str, tuple[int, ...]], where: str = "checkpoint") -> None:
    """Every expected HF tensor present with its shape; the error names the first missing/wrong ones."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing tensor(s) {missing[:5]}{more}")
    for k, want in expected.items():
        if shape_of(tensors, k) != want:
            raise CheckpointError(f"{where}: tensor {k} has shape {shape_of(tensors, k)}, expected {want} "
                                  f"for this config")


class LazyCanonical(Mapping):
    """Canonical Megatron tensors computed on access from (possibly lazy) HF tensors, one rule at a
    time: loading a sharded model reads each HF tensor once and holds at most one rule's tensors."""

    def __init__(self, hf: Mapping, rules: list[Rule], expected: dict, where: str = "checkpoint"):
        check_hf_tensors(hf, expected, where)
        self._hf = hf
        self._rule_of = {k: r for r in rules for k in r.mcore}
        self._cache: tuple[Rule | None, dict] = (None, {})

    def __getitem__(self, key: str) -> torch.Tensor:
        r = self._rule_of[key]
        if self._cache[0] is not r:
            self._cache = (r, dict(zip(r.mcore, forward(r, [self._hf[k] for k in r.hf]))))
        return self._cache[1][key]

    def read(self, key: str, sl: tuple[slice, ...]) -> torch.Tensor:
        return read(self._rule_of[key], key, self._hf, sl)

    def shape(self, key: str) -> tuple[int, ...]:
        return shape(self._rule_of[key], key, self._hf)

    def __contains__(self, key) -> bool:  # Mapping's default would compute (read) the tensor
        return key in self._rule_of

    def __iter__(self):
        return iter(self._rule_of)

    def __len__(self) -> int:
        return len(self._rule_of)


def to_hf(mc: Mapping, rules: list[Rule]) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors -> HF tensors for the given rules."""
    out = {}
    for r in rules:
        missing = [k for k in r.mcore if k not in mc]
        if missing:
            raise CheckpointError(f"Megatron state: missing tensor(s) {missing}")
        for k, t in zip(r.hf, inverse(r, [mc[k] for k in r.mcore])):
            out[k] = t.contiguous()
    return out
