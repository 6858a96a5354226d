"""Rollouts file: JSON Lines, one prompt group per line (ARCHITECTURE.md section 5).

    {"prompt": [ids], "responses": [[ids], ...], "rewards": [floats],
     "old_logprobs": [[floats], ...]?, "ref_logprobs": [[floats], ...]?, "loss_masks": [[0|1], ...]?,
     "old_values": [[floats], ...]?}

`old_values` (optional, PPO: `grpo.objective=ppo`): the critic's values at sampling time, one per response
token (loss/ppo.py); without them the critic's current values stand in, as the current log-probs do for
missing `old_logprobs`.

`loss_masks` (optional): one 0/1 list per response, the response's length; a 0 token (a tool's output,
an observation: context, not an action) gives no loss term and is not counted in the token mean, but
its log-prob is still computed and reported. A group in which every token is masked is refused.

`texts` and `row` (written by `longstraw rollout --dataset`: the decoded responses, the dataset row) are
for reading; `train` ignores them.

`load_rollouts` validates every group before any model work and raises `RolloutError` naming the
group (0-based index = line order among non-empty lines), the field and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


class RolloutError(ValueError):
    pass


READ_ONLY = ("texts", "row")
"""Fields `longstraw rollout --dataset` writes for people to read (the responses as text, the dataset row)
and `train` ignores."""


@dataclass
class RolloutGroup:
    prompt: list[int]
    responses: list[list[int]]
    rewards: list[float]
    old_logprobs: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    loss_masks: list[list[int]] | None = None
    old_values: list[list[float]] | None = None

    @property
    def group_size(self) -> int:
        return len(self.responses)

    def trained_tokens(self) -> list[int]:
        """Per response, the tokens that carry a loss term (all of them without loss_masks)."""
        if self.loss_masks is None:
            return [len(r) for r in self.responses]
        return [sum(m) for m in self.loss_masks]


def _ids(value, where: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise RolloutError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise RolloutError(f"{where}[{i}]={t!r}: token ids must be integers")
        if not 0 <= t < vocab_size:
            raise RolloutError(f"{where}[{i}]={t}: token id out of range [0, {vocab_size})")
    return value


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _per_response(value, where: str, responses: list[list[int]], kind: str, valid, rule: str) -> list[list]:
    """One list per response, each the response's length, every element `valid(x)` (else `rule` is named)."""
    if not isinstance(value, list) or len(value) != len(responses):
        n = len(value) if isinstance(value, list) else type(value).__name__
        raise RolloutError(f"{where}: expected one {kind}list per response ({len(responses)}), got {n}")
    for b, (xs, resp) in enumerate(zip(value, responses)):
        if not isinstance(xs, list) or len(xs) != len(resp):
            n = len(xs) if isinstance(xs, list) else type(xs).__name__
            raise RolloutError(f"{where}[{b}]: length {n} != response length {len(resp)}")
        for t, x in enumerate(xs):
            if not valid(x):
                raise RolloutError(f"{where}[{b}][{t}]={x!r}: {rule}")
    return value


def _floats_per_response(value, where: str, responses: list[list[int]]) -> list[list[float]]:
    return _per_response(value, where, responses, "", _finite_number, "log-probs must be finite numbers")


def _masks(value, where: str, responses: list[list[int]]) -> list[list[int]]:
    return _per_response(value, where, responses, "0/1 ",
                         lambda x: isinstance(x, int) and not isinstance(x, bool) and x in (0, 1),
                         "a loss mask holds 0 (no loss term) or 1 (trained)")


def check_trainable(masks: list[list[int]], where: str) -> None:
    """Refuses a group in which no token of any response is trained (naming its fully masked responses)."""
    if not any(any(mk) for mk in masks):
        raise RolloutError(f"{where}: every token of every response is masked (responses "
                           f"{list(range(len(masks)))} all zero in loss_masks): nothing to train")


def parse_group(obj: dict, index: int, vocab_size: int) -> RolloutGroup:
    g = f"group {index}"
    if not isinstance(obj, dict):
        raise RolloutError(f"{g}: expected a JSON object, got {type(obj).__name__}")
    for key in ("prompt", "responses", "rewards"):
        if key not in obj:
            raise RolloutError(f"{g}: missing field '{key}'")
    unknown = sorted(set(obj) - {"prompt", "responses", "rewards", "old_logprobs", "ref_logprobs", "loss_masks",
                                 "old_values"} - set(READ_ONLY))
    if unknown:
        raise RolloutError(f"{g}: unknown field(s) {unknown}")
    prompt = _ids(obj["prompt"], f"{g}: prompt", vocab_size)
    if not prompt:
        raise RolloutError(f"{g}: prompt is empty (at least one token is needed: it predicts the first response token)")
    responses = obj["responses"]
    if not isinstance(responses, list) or not responses:
        raise RolloutError(f"{g}: responses must be a non-empty list of token-id lists")
    for b, r in enumerate(responses):
        _ids(r, f"{g}: responses[{b}]", vocab_size)
        if not r:
            raise RolloutError(f"{g}: responses[{b}] is empty")
    rewards = obj["rewards"]
    if not isinstance(rewards, list) or len(rewards) != len(responses):
        n = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
        raise RolloutError(f"{g}: rewards count {n} != responses count {len(responses)}")
    for b, r in enumerate(rewards):
        if not _finite_number(r):
            raise RolloutError(f"{g}: rewards[{b}]={r!r}: rewards must be finite numbers")
    old = obj.get("old_logprobs")
    ref = obj.get("ref_logprobs")
    masks = obj.get("loss_masks")
    values = obj.get("old_values")
    if masks is not None:
        check_trainable(_masks(masks, f"{g}: loss_masks", responses), g)
    return RolloutGroup(prompt=prompt, responses=responses, rewards=[float(r) for r in rewards],
                        old_logprobs=None if old is None else _floats_per_response(old, f"{g}: old_logprobs", responses),
                        ref_logprobs=None if ref is None else _floats_per_response(ref, f"{g}: ref_logprobs", responses),
                        loss_masks=masks,
                        old_values=None if values is None else _per_response(
                            values, f"{g}: old_values", responses, "", _finite_number, "values must be finite numbers"))


def load_rollouts(path: str | Path, vocab_size: int) -> list[RolloutGroup]:
    p = Path(path)
    if not p.is_file():
        raise RolloutError(f"rollouts file {str(p)!r} does not exist")
    groups = []
    for line_no, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RolloutError(f"group {len(groups)} (line {line_no}): invalid JSON: {e}") from None
        groups.append(parse_group(obj, len(groups), vocab_size))
    if not groups:
        raise RolloutError(f"{p}: no prompt groups")
    return groups


def write_rollouts(path: str | Path, groups: list[RolloutGroup]) -> None:
    with open(path, "w") as f:
        for g in groups:
            obj = {"prompt": g.prompt, "responses": g.responses, "rewards": g.rewards}
            if g.old_logprobs is not None:
                obj["old_logprobs"] = g.old_logprobs
            if g.ref_logprobs is not None:
                obj["ref_logprobs"] = g.ref_logprobs
            if g.loss_masks is not None:
                obj["loss_masks"] = g.loss_masks
            if g.old_values is not None:
                obj["old_values"] = g.old_values
            f.write(json.dumps(obj) + "\n")
