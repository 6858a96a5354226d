"""UserPool (tasks/rewards.py): user reward functions and environments run in worker processes.

Each test spawns real workers (tens of milliseconds each), so the assertions are grouped: one pool
survives every failure kind in turn, and the next call after each failure still answers. The hanging
reward costs the one timeout (1 s). What this does not cover: a user import slower than the load timeout,
and workers dying while the pool is idle (found at the next call, as a crash)."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from longstraw_mcore.config.errors import ConfigError
from longstraw_mcore.tasks.rewards import RewardCall, UserPool, parse_spec

REWARDS = '''
import ctypes, os, time

def good(responses, row):
    print("print from user code")   # must reach stderr, not the protocol
    os.write(1, b"raw write to fd 1\\n")
    return [float(len(r)) + row.get("bonus", 0) for r in responses]

def plain(responses, row):           # would raise TypeError if token_ids were passed
    return [1.0] * len(responses)

def with_ids(responses, row, token_ids=None):
    return [float(sum(t)) for t in token_ids]

def with_kwargs(responses, row, **kwargs):
    return [float(len(kwargs["token_ids"][0]))] * len(responses)

def flaky(responses, row):
    mode = row["mode"]
    if mode == "raise":
        raise ValueError("bad row\\nsecond line")
    if mode == "hang":
        time.sleep(60)
    if mode == "nan":
        return [float("nan")] + [3.0] * (len(responses) - 1)
    if mode == "count":
        return [1.0]
    if mode == "str":
        return "1.0"
    if mode == "exit":
        os._exit(3)
    if mode == "segv":
        ctypes.string_at(0)
    return [2.0] * len(responses)

NOT_A_FUNCTION = 3
'''

ENVS = '''
import os

class CountEnv:
    def reset(self, row):
        self.n, self.target = 0, row["target"]

    def step(self, text):
        if text == "boom":
            raise RuntimeError("env broke")
        if text == "bad":
            return "obs", "yes", 1.0
        if text == "exit":
            os._exit(1)
        self.n += 1
        return f"obs {self.n} {text}", self.n >= self.target, 0.5

class NoStep:
    def reset(self, row):
        pass
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(REWARDS))
    (tmp_path / "user_envs.py").write_text(textwrap.dedent(ENVS))
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_rewards_failure_kinds_counts_and_logging(user_dir, capfd):
    logs = []
    pool = UserPool(workers=2, timeout_s=1.0, log=logs.append, on_failure=-1.0)
    names = pool.load_rewards(["user_rewards:good", "user_rewards:plain", "user_rewards:with_ids",
                               "user_rewards:with_kwargs", "user_rewards:flaky", f"{user_dir}/user_rewards.py:good"])
    assert names == ["good", "plain", "with_ids", "with_kwargs", "flaky", "good_2"]
    t0 = time.monotonic()
    with pool:
        pool.start()
        assert time.monotonic() - t0 < 5.0  # two workers, each in tens of milliseconds

        def call(fn, i, mode="ok", responses=("ab", "cde")):
            return RewardCall(fn, list(responses), {"mode": mode, "bonus": 10}, [[1, 2], [3, 4, 5]], i)

        modes = ["raise", "hang", "nan", "count", "str", "exit", "segv", "raise"]
        calls = ([call(0, 0), call(1, 1), call(2, 2), call(3, 3), call(5, 4)]
                 + [call(4, 10 + i, m) for i, m in enumerate(modes)] + [call(4, 99)])
        res = pool.score(calls)
        assert [r.values for r in res[:5]] == [[12.0, 13.0], [1.0, 1.0], [3.0, 12.0], [2.0, 2.0], [12.0, 13.0]]
        assert [r.failure for r in res[:5]] == [None] * 5
        kinds = ["exception", "timeout", "nonfinite", "wrong_count", "wrong_count", "crash", "crash", "exception"]
        assert [r.failure for r in res[5:-1]] == kinds
        assert res[7].values == [-1.0, 3.0]  # nonfinite: only the NaN is replaced
        assert all(r.values == [-1.0, -1.0] for i, r in enumerate(res[5:-1]) if kinds[i] != "nonfinite")
        assert res[-1] == ([2.0, 2.0], None)  # the pool kept working past every failure

        assert pool.failures == {("flaky", "exception"): 2, ("flaky", "timeout"): 1, ("flaky", "nonfinite"): 1,
                                 ("flaky", "wrong_count"): 2, ("flaky", "crash"): 2}
        assert pool.take_counts() == {"reward_failures/exception": 2, "reward_failures/timeout": 1,
                                      "reward_failures/nonfinite": 1, "reward_failures/wrong_count": 2,
                                      "reward_failures/crash": 2}
        assert pool.take_counts() == {}
        assert len(logs) == 5  # once per (function, kind)
        by_kind = {k: next(line for line in logs if f": {k} on row" in line) for k in set(kinds)}
        assert "row 10" in by_kind["exception"] and "ValueError: bad row (user_rewards.py:" in by_kind["exception"]
        assert "second line" not in by_kind["exception"] and all(len(line) < 300 for line in logs)
        assert "row 11" in by_kind["timeout"] and "row 12" in by_kind["nonfinite"]
        assert "returned 1 values for 2 responses" in by_kind["wrong_count"]
        assert "exited with code 3" in by_kind["crash"]
        assert pool.failures[("flaky", "crash")] == 2

        # after the respawns, every worker still answers, with token_ids still decided per function
        res = pool.score([call(2, 0), call(1, 1), call(4, 2), call(4, 3, "raise")])
        assert res[:3] == [([3.0, 12.0], None), ([1.0, 1.0], None), ([2.0, 2.0], None)]
        assert pool.take_counts() == {"reward_failures/exception": 1} and len(logs) == 5

    err = capfd.readouterr().err
    assert "print from user code" in err and "raw write to fd 1" in err
    assert pool._workers is None


def test_spec_errors_are_one_line_config_errors(user_dir, monkeypatch):
    for bad in ["no_colon", "mod:", "mod:1x", "a b:fn", "dir/file.txt:fn", ":fn"]:
        with pytest.raises(ConfigError, match="expected 'package.module:name' or 'path/to/file.py:name'"):
            parse_spec(bad, "--reward")
    monkeypatch.chdir(user_dir)
    assert parse_spec("user_rewards.py:good", "--reward") == (str(user_dir / "user_rewards.py"), "good")
    assert parse_spec("a.b_c:Fn", "--env") == ("a.b_c", "Fn")

    cases = [  # (rewards, env, what the message holds)
        (["no_such_mod_xyz:fn"], None, ["--reward no_such_mod_xyz:fn: cannot import 'no_such_mod_xyz' "
                                        "(ModuleNotFoundError: No module named 'no_such_mod_xyz')"]),
        (["user_rewards:missing"], None, ["--reward user_rewards:missing: 'user_rewards' has no attribute 'missing'"]),
        (["user_rewards:NOT_A_FUNCTION"], None, ["'NOT_A_FUNCTION' is a int, not a function"]),
        (["broken.py:fn"], None, ["--reward broken.py:fn: cannot import '", "broken.py' (ModuleNotFoundError: "
                                  "No module named 'no_such_module_xyz' (broken.py:1))"]),
        (["nofile.py:fn"], None, ["--reward nofile.py:fn: no file '"]),
        (["user_rewards:good"], "user_envs:NoStep", ["--env user_envs:NoStep: 'NoStep' has no method step"]),
    ]
    for rewards, env, parts in cases:
        pool = UserPool(workers=1, timeout_s=5.0)
        pool.load_rewards(rewards)
        if env:
            pool.load_env(env)
        with pytest.raises(ConfigError) as e:
            pool.start()
        message = str(e.value)
        assert all(p in message for p in parts) and "\n" not in message, message
        assert pool._workers is None

    # the file form, relative to the cwd, and the probe
    with UserPool(workers=1, timeout_s=5.0) as pool:
        pool.load_rewards(["user_rewards.py:good", "user_rewards.py:flaky"])
        pool.start()
        assert pool.score([RewardCall(0, ["xyz"], {}, [[1]], 0)]) == [([3.0], None)]
        assert pool.probe(0, {}, 8) is None
        assert pool.probe(1, {"mode": "raise"}, 8).startswith("exception: ValueError: bad row")
        with pytest.raises(ConfigError, match="^--reward user_rewards.py:flaky returned 1 values for 8 responses; "
                                              "a reward returns one float per response$"):
            pool.probe(1, {"mode": "count"}, 8)
        with pytest.raises(ConfigError, match="returned a str, not a list of 8 floats"):
            pool.probe(1, {"mode": "str"}, 8)
        assert pool.failures == {} and pool.take_counts() == {}  # probes are not counted


def test_env_episodes(user_dir):
    logs = []
    with UserPool(workers=2, timeout_s=5.0, log=logs.append, on_failure=-2.0) as pool:
        assert pool.load_env("user_envs:CountEnv") == "CountEnv"
        pool.start()
        a, b = pool.env_new({"target": 2}, 0), pool.env_new({"target": 3}, 1)
        assert isinstance(a, int) and isinstance(b, int) and pool._episodes[a][0] != pool._episodes[b][0]
        assert pool.env_step(a, "x") == ("obs 1 x", False, 0.5, None)
        assert pool.env_steps([(b, "p"), (a, "y")]) == [("obs 1 p", False, 0.5, None), ("obs 2 y", True, 0.5, None)]
        pool.env_close(a)
        assert pool.env_step(b, "q") == ("obs 2 q", False, 0.5, None)  # its state lives in its worker

        assert pool.env_step(b, "boom") == ("", True, -2.0, "exception")  # a failure ends the episode
        with pytest.raises(KeyError):
            pool.env_step(b, "again")
        c = pool.env_new({"target": 5}, 7)
        assert pool.env_step(c, "boom")[3] == "exception"
        d = pool.env_new({"target": 5}, 8)
        assert pool.env_step(d, "bad") == ("", True, -2.0, "bad_return")
        assert pool.env_new({}, 9) == "exception"  # reset raised (KeyError: 'target')
        assert pool.env_failures == {"exception": 3, "bad_return": 1}
        assert pool.take_counts() == {"env_failures/exception": 3, "env_failures/bad_return": 1}
        assert len(logs) == 2 and "row 1" in logs[0] and "RuntimeError: env broke" in logs[0]
        assert "row 8" in logs[1] and "done is a str, not a bool" in logs[1]

        # a crash loses every episode of that worker; the other worker's go on
        e, f, g = (pool.env_new({"target": 3}, i) for i in (10, 11, 12))
        assert [pool._episodes[h][0] for h in (e, f, g)] == [0, 1, 0]
        assert pool.env_steps([(e, "exit"), (f, "z"), (g, "z")]) == [
            ("", True, -2.0, "crash"), ("obs 1 z", False, 0.5, None), ("", True, -2.0, "crash")]
        assert pool.take_counts() == {"env_failures/crash": 2} and "row 10" in logs[2] and "exited with code 1" in logs[2]
        h = pool.env_new({"target": 1}, 13)
        assert pool.env_step(h, "z") == ("obs 1 z", True, 0.5, None)
        with pytest.raises(TypeError):  # a row json cannot write fails before anything is sent
            pool.env_new({"x": object()}, 14)
        assert pool.env_step(f, "w") == ("obs 2 w", False, 0.5, None)
