"""Run a function on N gloo ranks spawned on this machine (2-8), for tests and the CPU demo.

`run_ranks(fn, world_size, ...)` starts `world_size` processes with the `forkserver` start method, each
in its own process group (so a timeout kills the rank *and* anything it started, e.g. Megatron's
checkpoint-writer children), initialises `torch.distributed` on gloo over a free loopback port,
calls `fn(rank, world_size, *args)`, and returns the per-rank results in rank order. Any rank's
exception is re-raised in the caller with that rank's traceback; a rank that does not finish within
`timeout_s` gets the whole group killed and a `TimeoutError` naming the ranks still running.
`fn` must be importable by module path (a module-level function), as it is pickled by name.

The fork server (one per calling process, started on first use) imports torch, Megatron-Core and
transformers' two model families once (`PRELOAD`, about 10 s of CPU); every rank of every later world
is forked from it with those modules loaded, instead of importing them again per rank as `spawn` would.
The fork server holds no threads, locks or process groups, so forking it is safe. Each rank gets the
caller's environment as it is at the call (the fork server's own is from its start). Where a CUDA device
exists the ranks are spawned instead: those imports initialise CUDA in the fork server, and a forked
child cannot initialise it again ("Cannot re-initialize CUDA in forked subprocess", seen on an H200).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import time
import traceback
from typing import Any, Callable, Sequence

import multiprocessing as mp

# Imported once in the fork server; a module that is not installed is skipped. longstraw_mcore first:
# its import hook makes Megatron's torch.compile decorations lazy (lazy_compile.py).
PRELOAD = ("longstraw_mcore", "torch", "torch.distributed", "megatron.core.parallel_state",
           "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.distributed",
           "megatron.core.optimizer", "megatron.core.transformer.moe.moe_layer", "transformers",
           # the two families' transformers models (the references ranks build): importing one imports
           # torch._dynamo and torch._inductor (transformers' hub kernels), ~3 s a rank otherwise; Qwen3.5's
           # with its torch Gated DeltaNet rule bound, never fla's (bench/hf_kernels.py)
           "longstraw_mcore.bench.hf_torch_reference", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")


class RankFailure(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def _choose_port(hold: bool) -> socket.socket:
    """A loopback socket bound to a port free now: the kernel's pick or, with LONGSTRAW_PORTS=LO-HI set, one in
    that range. Bound without SO_REUSEADDR, so a port that anything holds is never chosen; with `hold`, the
    flag is set afterwards (reserve_port)."""
    span = os.environ.get("LONGSTRAW_PORTS")
    if not span:
        tries = [0]
    else:
        import random

        try:
            lo, hi = (int(x) for x in span.split("-"))
        except ValueError:
            lo = hi = 0
        if not 1024 <= lo <= hi <= 65535:
            raise ValueError(f"LONGSTRAW_PORTS={span!r}: a range LO-HI of TCP ports, 1024 <= LO <= HI <= 65535")
        tries = random.sample(range(lo, hi + 1), min(64, hi - lo + 1))
    for port in tries:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        if hold:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s
    raise OSError(f"LONGSTRAW_PORTS={span}: no free port among the {len(tries)} tried")


def free_port() -> int:
    """A loopback TCP port free now, for a rendezvous in this process (bound a moment later): the kernel's
    pick or, with LONGSTRAW_PORTS=LO-HI set, one in that range (tests/conftest.py gives each pytest worker its
    own range below the kernel's ephemeral ports, so concurrent workers' launches never pick each other's).
    For a store that another process will serve, `reserve_port`."""
    s = _choose_port(hold=False)
    port = s.getsockname()[1]
    s.close()
    return port


def reserve_port() -> socket.socket:
    """A port for a rendezvous store that another process (rank 0) will serve, chosen as `free_port` chooses
    and held until the caller closes the returned socket (`.getsockname()[1]` is the port). Between a launch
    choosing its port and rank 0 binding it lie rank 0's imports: seconds, minutes on a loaded machine, time
    in which another launch or the kernel's choice of a local port for an outgoing connection (gloo's mesh
    makes hundreds) could take a port that was only free. The held socket never listens and carries
    SO_REUSEADDR, so the store (libuv's and torch's own server bind with it) binds beside it, while a plain
    bind (this project's choice of a port, in another launch) is refused and the kernel picks no port that a
    socket is bound to for an outgoing connection. (A program that binds a port it was told, with
    SO_REUSEADDR, could still bind beside it: a given port is the user's to keep apart.)"""
    return _choose_port(hold=True)


def _child(fn, rank: int, world_size: int, port: int, args: Sequence[Any], out: "mp.Queue",
           environ: dict[str, str]) -> None:
    os.setpgrp()  # own process group: the parent can kill us and our children together
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the fork server's at its start
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    # One compute thread per rank: N ranks share 2 cores; oversubscribing threads only slows them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle (tensors by value): the queue's own pickler would share tensor storage through
        # file descriptors that vanish when this process exits before the parent reads them.
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _kill(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # (not started)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        p.join(5)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size={world_size}: run_ranks spawns 1 to 8 local ranks")
    import torch

    if torch.cuda.is_available():  # the fork server's imports initialise CUDA, which a fork cannot re-initialise
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the fork server starts (first call)
    out = ctx.Queue()
    held = reserve_port()  # (until every rank is gone: rank 0 binds it after the fork)
    port = held.getsockname()[1]
    environ = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, out, environ), daemon=False)
             for r in range(world_size)]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                running = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {running} of {world_size} still running after {timeout_s:.0f} s; killed")
            try:
                rank, status, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                      "without reporting (killed by a signal or out of memory?)")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        if len(results) < world_size:
            _kill(procs)
        else:
            for p in procs:
                p.join(30)
            _kill([p for p in procs if p.is_alive()])
        held.close()
    return [results[r] for r in range(world_size)]
