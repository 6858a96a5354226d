"""User reward functions and environments, run in a pool of worker processes (tasks/user_worker.py).

    pool = UserPool(workers=2, timeout_s=30.0, on_failure=0.0)
    names = pool.load_rewards(["mymod:score", "path/to/file.py:length_penalty"])
    pool.load_env("mymod:MyEnv")          # optional
    pool.start()                          # every worker imports them now: a bad spec is a ConfigError here
    results = pool.score([RewardCall(0, responses, row, token_ids, row_index), ...])

A user's code never runs in the trainer's process: a crash (os._exit, segfault), a hang or an exception
costs one call, never the run. Calls run concurrently, one per worker at a time; each has `timeout_s`
(the worker is polled, killed at its deadline and respawned). Results come back in call order.

Failure kinds of a reward call (every value of the call becomes `on_failure`, except for "nonfinite"):
    exception    the function raised
    timeout      no answer within timeout_s (the worker is killed and respawned)
    nonfinite    some values were NaN or infinite: just those are replaced
    wrong_count  not one number per response (wrong length, or not a list of numbers)
    crash        the worker died (it is respawned)
Environment episodes end at their first failure (done=True, reward=on_failure); kinds as above, with
"bad_return" for a step that does not return (obs: str, done: bool, reward: float). Failures are counted
(`failures`, `env_failures`, and per step by `take_counts`) and logged once per (function, kind).
Names are the specs' attribute names (a def's __name__), made unique, known before any import."""

from __future__ import annotations

import atexit
import math
import os
from collections import Counter
from typing import Callable, NamedTuple

from longstraw_mcore.config.errors import ConfigError
from longstraw_mcore.tasks.worker_proc import WorkerSet

SPEC_FORMS = "'package.module:name' or 'path/to/file.py:name'"


def parse_spec(spec: str, what: str) -> tuple[str, str]:
    """('package.module' or an absolute path ending in .py, attribute name) of `spec`; `what` names the
    option in errors ('--reward')."""
    target, sep, attr = spec.rpartition(":")
    is_file = target.endswith(".py")  # before the module test: 'rewards.py' is also a dotted name
    is_module = not is_file and all(part.isidentifier() for part in target.split("."))
    if not (sep and attr.isidentifier() and (is_module or is_file)):
        raise ConfigError(f"{what} {spec!r}: expected {SPEC_FORMS}")
    return (os.path.abspath(target) if is_file else target), attr


class RewardCall(NamedTuple):
    """One reward function over one group: `token_ids` go only to a function that accepts them."""
    fn_index: int
    responses: list[str]
    row: dict
    token_ids: list[list[int]]
    row_index: int


class RewardResult(NamedTuple):
    values: list[float]  # len(responses), failed entries = on_failure
    failure: str | None  # None, or the failure kind


class UserPool:
    """`workers` processes hosting the user's reward functions and environment; see the module docstring."""

    def __init__(self, workers: int, timeout_s: float, log: Callable[[str], None] = print, *,
                 on_failure: float = 0.0, load_timeout_s: float = 120.0):
        if workers < 1 or not timeout_s > 0:
            raise ConfigError(f"reward.workers={workers}, reward.timeout_s={timeout_s}: both must be positive")
        self.n_workers, self.timeout_s, self.log = workers, timeout_s, log
        self.on_failure, self.load_timeout_s = float(on_failure), load_timeout_s
        self.names: list[str] = []
        self._rewards: list[tuple[str, str, str]] = []  # (spec, target, attr)
        self._env: tuple[str, str, str] | None = None
        self._token_ids: list[bool] = []
        self._workers: WorkerSet | None = None
        self._episodes: dict[int, tuple[int, int, int]] = {}  # handle -> (slot, generation, row_index)
        self._next_handle = 0
        self.failures: Counter = Counter()  # (fn_name, kind) -> count, cumulative
        self.env_failures: Counter = Counter()  # kind -> count, cumulative
        self._step_counts: Counter = Counter()
        self._logged: set = set()

    # -- loading ---------------------------------------------------------------------------------------
    def load_rewards(self, specs: list[str]) -> list[str]:
        """Register reward functions (imported by start()); their unique names, in order."""
        assert self._workers is None, "load rewards before start()"
        for spec in specs:
            target, attr = parse_spec(spec, "--reward")
            name, k = attr, 2
            while name in self.names:
                name, k = f"{attr}_{k}", k + 1
            self._rewards.append((spec, target, attr))
            self.names.append(name)
        return self.names[-len(specs):] if specs else []

    def load_env(self, spec: str) -> str:
        """Register the environment class (imported by start()); its name."""
        assert self._workers is None, "load the environment before start()"
        self._env = (spec, *parse_spec(spec, "--env"))
        return self._env[2]

    def start(self) -> None:
        """Spawn the workers and import the user's code in each (concurrently); ConfigError on a bad spec."""
        assert self._workers is None, "start() twice"
        self._workers = WorkerSet(self.n_workers, self.timeout_s, self._load_request(), self.load_timeout_s)
        atexit.register(self.close)
        try:
            reply = self._workers.load()
        except BaseException:
            self.close()
            raise
        if not reply["ok"]:
            self.close()
            i, specs = reply["index"], [f"--reward {s}" for s, _, _ in self._rewards]
            specs += [f"--env {self._env[0]}"] if self._env else []
            raise ConfigError(f"{', '.join(specs) if i is None else specs[i]}: {reply['cause']}")
        self._token_ids = reply["token_ids"]

    def _load_request(self) -> dict:
        return {"op": "load", "rewards": [[t, a] for _, t, a in self._rewards],
                "env": list(self._env[1:]) if self._env else None}

    def _run(self, jobs: list[tuple[int | None, int | None, dict]]) -> list[dict]:
        assert self._workers is not None, "start() the pool first"
        return self._workers.run(jobs)

    def _count(self, fn_name: str | None, kind: str, row_index: int, cause: str, what: str = "") -> None:
        """Count a failure of reward `fn_name` (None: of the environment's `what`); log the first of each
        (function, kind), and of each kind for the environment."""
        key = (fn_name, kind)
        if fn_name is None:
            self.env_failures[kind] += 1
            self._step_counts[f"env_failures/{kind}"] += 1
            label = f"environment {what}"
        else:
            self.failures[key] += 1
            self._step_counts[f"reward_failures/{kind}"] += 1
            label = f"reward {fn_name}"
        if key not in self._logged:
            self._logged.add(key)
            self.log(f"{label}: {kind} on row {row_index}: {cause} (later {kind} failures are counted, not logged)")

    def take_counts(self) -> dict[str, int]:
        """Failures since the last call: {'reward_failures/<kind>': n, 'env_failures/<kind>': n}."""
        out, self._step_counts = dict(self._step_counts), Counter()
        return out

    # -- rewards ---------------------------------------------------------------------------------------
    def _request(self, call: RewardCall) -> dict:
        req = {"op": "reward", "fn": call.fn_index, "responses": list(call.responses), "row": call.row}
        if self._token_ids[call.fn_index]:
            req["token_ids"] = [[int(t) for t in ids] for ids in call.token_ids]
        return req

    def _judge(self, call: RewardCall, reply: dict) -> tuple[RewardResult, str | None]:
        """The result of one reply, and the failure's cause."""
        n = len(call.responses)
        if not reply["ok"]:
            return RewardResult([self.on_failure] * n, reply["kind"]), reply["cause"]
        values = reply["values"]
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if not bad:
            return RewardResult(values, None), None
        cause = f"{len(bad)} of {n} values non-finite (response {bad[0]}: {values[bad[0]]})"
        return RewardResult([self.on_failure if i in bad else v for i, v in enumerate(values)], "nonfinite"), cause

    def score(self, calls: list[RewardCall]) -> list[RewardResult]:
        """Every call's values, in call order; failures replaced by on_failure, counted and logged."""
        replies = self._run([(None, None, self._request(c)) for c in calls])
        results = []
        for call, reply in zip(calls, replies):
            result, cause = self._judge(call, reply)
            if result.failure:
                self._count(self.names[call.fn_index], result.failure, call.row_index, cause)
            results.append(result)
        return results

    def probe(self, fn_index: int, row: dict, group_size: int) -> str | None:
        """Call reward `fn_index` on `group_size` empty responses: ConfigError if it does not return one
        number per response; the cause if it failed otherwise (the caller warns), else None. Not counted."""
        call = RewardCall(fn_index, [""] * group_size, row, [[] for _ in range(group_size)], -1)
        result, cause = self._judge(call, self._run([(None, None, self._request(call))])[0])
        if result.failure == "wrong_count":
            raise ConfigError(f"--reward {self._rewards[fn_index][0]} {cause}; a reward returns one float per response")
        return None if result.failure is None else f"{result.failure}: {cause}"

    # -- environment episodes --------------------------------------------------------------------------
    def env_new(self, row: dict, row_index: int) -> int | str:
        """A new episode (the env constructed and reset with `row`), pinned to the worker with the fewest
        episodes: its handle, or the failure kind (already counted and logged) if that failed."""
        assert self._env is not None, "load_env() before env_new()"
        load = Counter(slot for slot, _, _ in self._episodes.values())
        slot = min(range(self.n_workers), key=lambda s: (load[s], s))
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        reply = self._run([(slot, self._workers.generation(slot), {"op": "env_new", "h": handle, "row": row})])[0]
        if not reply["ok"]:
            self._count(None, reply["kind"], row_index, reply["cause"], "reset")
            return reply["kind"]
        self._episodes[handle] = (slot, self._workers.generation(slot), row_index)
        return handle

    def env_step(self, handle: int, text: str) -> tuple[str, bool, float, str | None]:
        """(observation, done, reward, failure kind or None); a failure ends the episode."""
        return self.env_steps([(handle, text)])[0]

    def env_steps(self, steps: list[tuple[int, str]]) -> list[tuple[str, bool, float, str | None]]:
        """env_step for several episodes at once, concurrently over their workers, in order."""
        for handle, _ in steps:
            if handle not in self._episodes:
                raise KeyError(f"episode {handle} was closed or ended by a failure")
        jobs = [(*self._episodes[h][:2], {"op": "env_step", "h": h, "text": text}) for h, text in steps]
        out = []
        for (handle, _), reply in zip(steps, self._run(jobs)):
            if reply["ok"] and not math.isfinite(reply["reward"]):
                reply = {"ok": False, "kind": "nonfinite", "cause": f"step's reward is {reply['reward']}"}
            out.append((reply["obs"], reply["done"], reply["reward"], None) if reply["ok"] else
                       self._env_failed(handle, reply))
        return out

    def _env_failed(self, handle: int, reply: dict) -> tuple[str, bool, float, str]:
        _, _, row_index = self._episodes.pop(handle)
        self._count(None, reply["kind"], row_index, reply["cause"], "step")
        return "", True, self.on_failure, reply["kind"]

    def env_close(self, handle: int) -> None:
        """Forget an episode (a no-op for one that already ended by failure)."""
        episode = self._episodes.pop(handle, None)
        if episode is not None and self._workers.generation(episode[0]) == episode[1]:
            self._workers.send(episode[0], {"op": "env_close", "h": handle})

    # -- lifetime --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (their input closes; one still running after 1 s is killed). Idempotent."""
        atexit.unregister(self.close)
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __enter__(self) -> UserPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
