"""One worker process for user code (tasks/rewards.py's UserPool): imports the user's reward functions and
environment class, then answers one JSON request per line, one request at a time.

Imports only the standard library and the user's modules, never torch or longstraw_mcore: a worker starts
in tens of milliseconds, and a user's crash or hang costs this process only (the pool kills and respawns it).

    {"op": "load", "rewards": [[target, attr], ...], "env": [target, attr] | null}
        -> {"ok": true, "token_ids": [bool per reward]} | {"ok": false, "index": i (-1: the env), "cause": str}
    {"op": "reward", "fn": i, "responses": [...], "row": {...}, "token_ids": [[int]] (only if accepted)}
        -> {"ok": true, "values": [float, ...]}
    {"op": "env_new", "h": h, "row": {...}}  -> {"ok": true}
    {"op": "env_step", "h": h, "text": str}  -> {"ok": true, "obs": str, "done": bool, "reward": float}
    {"op": "env_close", "h": h}              (no reply)
    a failure of a user call -> {"ok": false, "kind": "exception" | "wrong_count" | "bad_return", "cause": str}

A target ending in ".py" is a file path, anything else a module name. The protocol reads a dup of fd 0 and
writes a dup of fd 1; fd 1 then points at stderr and fd 0 at /dev/null, so a user's print() (or a C
library's write to fd 1, or input()) can neither corrupt nor steal the protocol. Values are checked for
type and count here; finiteness is the pool's to judge (JSON carries NaN and Infinity)."""

import functools
import importlib
import importlib.util
import inspect
import json
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback

REWARDS: list = []
ENV = [None]  # the environment class, once loaded
EPISODES: dict = {}  # handle -> environment instance


class Bad(Exception):
    """A user call returned something of the wrong shape or type (kind = the failure kind)."""

    def __init__(self, kind: str, cause: str):
        super().__init__(cause)
        self.kind = kind


@functools.cache
def library_prefixes() -> tuple[str, ...]:
    """Where frames are not the user's: the standard library (importlib's frozen ones too), installed packages
    (sysconfig costs tens of milliseconds: asked at the first failure, not at start)."""
    return ("<", *{sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def cause_of(e: BaseException) -> str:
    """'Type: message (file.py:line)', first line, at most 160 characters."""
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
    library = library_prefixes()
    user = [f for f in traceback.extract_tb(e.__traceback__)  # the innermost frame of the user's own code
            if not f.filename.startswith(library) and f.filename != __file__]
    if user:
        text += f" ({os.path.basename(user[-1].filename)}:{user[-1].lineno})"
    return text if len(text) <= 160 else text[:157] + "..."


def load(target: str, attr: str, n: int):
    """The object `attr` of module or file `target`; raises Bad('load', cause) naming what went wrong."""
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise Bad("load", f"no file {target!r}")
            sys.path.append(os.path.dirname(target))  # a file's sibling helpers import, as for a script
            name = f"_longstraw_user_{n}"
            spec = importlib.util.spec_from_file_location(name, target)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Bad:
        raise
    except BaseException as e:  # SystemExit at import too
        raise Bad("load", f"cannot import {target!r} ({cause_of(e)})") from None
    if not hasattr(module, attr):
        raise Bad("load", f"{target!r} has no attribute {attr!r}")
    return getattr(module, attr)


def accepts_token_ids(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.name == "token_ids" or p.kind is p.VAR_KEYWORD for p in params)


def on_load(req: dict) -> dict:
    rewards, index = [], 0
    try:
        for index, (target, attr) in enumerate(req["rewards"]):
            fn = load(target, attr, index)
            if not callable(fn):
                raise Bad("load", f"{attr!r} is a {type(fn).__name__}, not a function")
            rewards.append(fn)
        index = -1
        if req["env"] is not None:
            target, attr = req["env"]
            cls = load(target, attr, len(rewards))
            missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
            if not isinstance(cls, type) or missing:
                what = f"has no method {' or '.join(missing)}" if missing else f"is a {type(cls).__name__}"
                raise Bad("load", f"{attr!r} {what} (an environment is a class with reset(row) and step(text))")
            ENV[0] = cls
    except Bad as e:
        return {"ok": False, "index": index, "cause": str(e)}
    REWARDS[:] = rewards
    return {"ok": True, "token_ids": [accepts_token_ids(f) for f in rewards]}


def as_float(v, what: str) -> float:
    if isinstance(v, (str, bytes)) or v is None:
        raise Bad("bad_return", f"{what} is a {type(v).__name__}, not a number")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise Bad("bad_return", f"{what} is a {type(v).__name__}, not a number") from None


def on_reward(req: dict) -> dict:
    kwargs = {"token_ids": req["token_ids"]} if "token_ids" in req else {}
    out = REWARDS[req["fn"]](req["responses"], req["row"], **kwargs)
    n = len(req["responses"])
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise Bad("wrong_count", f"returned a {type(out).__name__}, not a list of {n} floats")
    out = list(out)
    if len(out) != n:
        raise Bad("wrong_count", f"returned {len(out)} values for {n} responses")
    try:
        return {"ok": True, "values": [as_float(v, f"value {i}") for i, v in enumerate(out)]}
    except Bad as e:
        raise Bad("wrong_count", f"returned a list whose {e}") from None


def on_env_new(req: dict) -> dict:
    env = ENV[0]()
    env.reset(req["row"])
    EPISODES[req["h"]] = env
    return {"ok": True}


def on_env_step(req: dict) -> dict:
    out = EPISODES[req["h"]].step(req["text"])
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise Bad("bad_return", f"step returned a {type(out).__name__}, not (obs: str, done: bool, reward: float)")
    obs, done, reward = out
    if not isinstance(obs, str):
        raise Bad("bad_return", f"step's observation is a {type(obs).__name__}, not a str")
    if not (isinstance(done, (bool, int)) or type(done).__name__ == "bool_"):  # numpy's bool too
        raise Bad("bad_return", f"step's done is a {type(done).__name__}, not a bool")
    return {"ok": True, "obs": obs, "done": bool(done), "reward": as_float(reward, "step's reward")}


HANDLERS = {"load": on_load, "reward": on_reward, "env_new": on_env_new, "env_step": on_env_step}


def watch_parent(parent: int) -> None:
    """Exit when the parent dies, even if user code hangs the main thread (no orphan spinning on a CPU)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this script's folder would shadow a user's module named like ours
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the pool decides
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    for line in proto_in:
        req = json.loads(line)
        if req["op"] == "env_close":
            EPISODES.pop(req["h"], None)
            continue
        try:
            reply = HANDLERS[req["op"]](req)
        except Bad as e:
            reply = {"ok": False, "kind": e.kind, "cause": str(e)}
        except BaseException as e:  # sys.exit() in user code too; SIGINT is ignored
            reply = {"ok": False, "kind": "exception", "cause": cause_of(e)}
        if not reply["ok"] and req["op"] in ("env_new", "env_step"):
            EPISODES.pop(req["h"], None)  # a failure ends the episode
        proto_out.write(json.dumps(reply) + "\n")
        proto_out.flush()


if __name__ == "__main__":
    main()
