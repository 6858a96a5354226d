"""Compile Triton kernels for Hopper (sm_90) on a machine with no GPU, through the project's own call paths.

`OfflineHopper(mode, winners)` is a context manager. Inside it:
- torch reports one device of capability (9, 0) (fla's import-time hardware probes read it), and Triton's
  active driver is a stand-in that reports `GPUTarget("cuda", 90, 32)` with an H100's properties (232,448 B
  of shared memory per block, 132 SMs; an H200 has the same per-block limits, and both share the backend
  hash: ptxas version + arch 90);
- every `JITFunction.run` compiles and launches nothing (`warmup=True`): the kernel is built at the real
  call's specialisation (dtypes, 16-byte alignment, ints divisible by 16 or equal to 1, constexprs) and put
  in `TRITON_CACHE_DIR`, exactly where the device's JIT will look for it;
- every autotuner compiles instead of benchmarking: `mode="full"` compiles every config its pruning keeps
  (the device then only benchmarks), `mode="pinned"` compiles one config per (kernel, tuning key) (the
  device's earlier winner from `winners`, else the first the pruning keeps) and writes Triton's own on-disk
  autotune record for it (`<kernel>.autotune.json`, through `Autotuner.check_disk_cache`), so a device
  process with `TRITON_CACHE_AUTOTUNING=1` neither benchmarks nor compiles;
- or, `mode="check"`, autotuners run as on the device (Triton's own `Autotuner.run`: a pinned record is
  read, anything else would be benchmarked and fails here): a fresh process replaying the paths this way
  against a built cache shows what a device would still compile (`records` with `cache_hit` False).

Callers pass CPU tensors of the device run's shapes and dtypes; outputs are left unwritten (nothing runs),
so a path must not branch on computed values. `records` lists every compile (kernel, config, seconds,
cache hit). The cache must be built at the fixed path the device uses: Triton's group files hold absolute
paths (see `triton_cache`).

Contract: the produced cache hits on a device only with byte-identical Triton (its key hashes Triton's
sources and libtriton), the same kernel sources (fla version, this project's kernels) and the same
cache-invalidating `TRITON_*` variables; `triton_cache.manifest` records what a device checks.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

HOPPER_PROPERTIES = dict(max_shared_mem=232448, multiprocessor_count=132, max_num_regs=65536, warpSize=32,
                         sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=5120)
MODES = ("full", "pinned", "check")


@dataclasses.dataclass
class CompileRecord:
    """One compile (or cache hit) seen by Triton's compilation listener."""
    kernel: str
    hash: str
    cache_hit: bool
    seconds: float
    config: str = ""
    tuning_key: str = ""


def load_winners(folder: Path) -> dict[tuple[str, str], dict]:
    """The device's autotune winners under `folder` (Triton's `<kernel>.autotune.json` records, as
    `tools/triton_cache.py harvest` brings them back): {(kernel, tuning key as JSON): best config's dict}."""
    out: dict[tuple[str, str], dict] = {}
    for f in sorted(Path(folder).rglob("*.autotune.json")):
        rec = json.loads(f.read_text())
        timings = rec["configs_timings"]
        best = min(timings, key=lambda ct: ct[1] if isinstance(ct[1], (int, float)) else ct[1][0])[0]
        out[(f.name[: -len(".autotune.json")], json.dumps(list(rec["key"])))] = best
    return out


def _config_matches(cfg, want: dict) -> bool:
    return (cfg.kwargs == want.get("kwargs") and cfg.num_warps == want.get("num_warps")
            and cfg.num_stages == want.get("num_stages") and cfg.num_ctas == want.get("num_ctas", 1))


class _Driver:
    """Triton's active-driver interface, answering as one Hopper GPU and launching nothing."""

    def __init__(self, torch):
        from triton.backends.compiler import GPUTarget

        self._torch, self._target = torch, GPUTarget("cuda", 90, 32)

        class _Utils:
            def get_device_properties(self, index):
                return dict(HOPPER_PROPERTIES)

        self.utils = _Utils()
        self.launcher_cls = None

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def set_current_device(self, device):
        pass

    def get_active_torch_device(self):
        return self._torch.device("cpu")

    def get_device_interface(self):
        return self._torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("offline: an autotuner found no pinned record and would benchmark here (on the device it "
                           "would compile and time every config)")

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)

    def is_active(self):
        return True


class OfflineHopper:
    """See the module docstring. `winners`: `load_winners(...)` (pinned mode); `log`: print one line per
    autotuned kernel and key (rank-free tool output)."""

    def __init__(self, mode: str = "full", winners: dict | None = None, log=None):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        self.mode, self.winners, self.log = mode, winners or {}, log
        self.records: list[CompileRecord] = []
        self.autotuned: list[dict] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._current: dict = {}

    # -- patching --------------------------------------------------------------------------------------
    def _patch(self, owner, name, value):
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        import torch
        import triton
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction

        for name, value in dict(get_device_capability=lambda device=None: (9, 0),
                                get_device_name=lambda device=None: "NVIDIA H100 80GB HBM3",
                                device_count=lambda: 1, current_device=lambda: 0).items():
            self._patch(torch.cuda, name, value)
        self._old_driver = getattr(driver, "_active", None)  # (reading `driver.active` would look for a GPU)
        driver.set_active(_Driver(torch))
        self._patch(triton.knobs.compilation, "listener", self._listener)
        jit_run = JITFunction.run

        def compile_only(fn, *args, grid=None, warmup=False, **kwargs):
            return jit_run(fn, *args, grid=grid, warmup=True, **kwargs)

        self._patch(JITFunction, "run", compile_only)
        if self.mode == "check":
            return self
        aot = self

        def autotune_compile(tuner, *args, **kwargs):
            return aot._autotune(tuner, *args, **kwargs)

        self._patch(Autotuner, "run", autotune_compile)
        return self

    def __exit__(self, *exc):
        from triton.runtime.driver import driver

        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        driver._active = self._old_driver  # (reset_active() would look for a GPU)
        return False

    # -- what the patches do ---------------------------------------------------------------------------
    def _listener(self, src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, **_):
        us = 0.0
        if times is not None:
            us = times.ir_initialization + sum(t for _, t in times.lowering_stages) + times.store_results
        self.records.append(CompileRecord(kernel=getattr(src, "name", "?"), hash=(metadata or {}).get("hash", ""),
                                          cache_hit=bool(cache_hit), seconds=round(us / 1e6, 3),
                                          config=self._current.get("config", ""),
                                          tuning_key=self._current.get("tuning_key", "")))

    def _autotune(self, tuner, *args, **kwargs):
        tuner.nargs = dict(zip(tuner.arg_names, args))
        named = {k: v for k, v in {**tuner.nargs, **kwargs}.items() if k in tuner.arg_names}
        key = tuple([named[k] for k in tuner.keys if k in named] + [str(v.dtype) for v in named.values()
                                                                     if hasattr(v, "dtype")])
        configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else list(tuner.configs)
        name = tuner.base_fn.__name__
        key_json = json.dumps(list(key), default=str)
        if self.mode == "full" or len(configs) == 1:
            chosen = configs
        else:
            want = self.winners.get((name, key_json))
            chosen = [next((c for c in configs if want is not None and _config_matches(c, want)), configs[0])]
        t0, result = time.perf_counter(), None
        for cfg in chosen:
            self._current = dict(config=str(cfg), tuning_key=key_json)
            try:
                result = tuner.fn.run(*args, **kwargs, **cfg.all_kwargs()) or result
            except Exception as e:  # (a config the device's autotuner would drop too: out of resources)
                if self.log:
                    self.log(f"[aot] {name} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            finally:
                self._current = {}
        if self.mode == "pinned" and len(configs) > 1:
            self._write_record(tuner, key, configs, chosen[0])
        self.autotuned.append(dict(kernel=name, tuning_key=key_json, configs=len(configs), compiled=len(chosen),
                                   seconds=round(time.perf_counter() - t0, 2)))
        if self.log:
            self.log(f"[aot] {name}: {len(chosen)} of {len(configs)} configs in {time.perf_counter() - t0:.1f} s")
        tuner.nargs = None
        return result

    @staticmethod
    def _write_record(tuner, key, configs, chosen) -> None:
        """Triton's own on-disk autotune record for (kernel, key, pruned configs), naming `chosen` fastest:
        written by Triton's `check_disk_cache` so its key and format are the device's."""

        def bench():
            tuner.configs_timings = {chosen: [0.0, 0.0, 0.0]}
            tuner.cache[key] = chosen

        tuner.cache.pop(key, None)
        tuner.check_disk_cache(key, configs, bench)
