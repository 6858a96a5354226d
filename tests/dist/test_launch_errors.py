"""Launch-time errors: a world size the layout does not divide is refused before any Megatron
process group exists; the command line reports config errors with exit code 2. (The command line running
the model end to end in bf16: tests/dist/test_many_ranks_under_load.py, on 16 ranks.)"""

from __future__ import annotations

import os
import subprocess
import sys

from longstraw_mcore.launch_local import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mismatch_worker(rank, world_size):
    from megatron.core import parallel_state

    from longstraw_mcore.config import ConfigError, load_config
    from longstraw_mcore.parallel.groups import setup_parallel

    cfg = load_config(os.path.join(ROOT, "configs/qwen3.6-tiny.yaml"), ["parallel.tp=2", "device=cpu"])
    try:
        setup_parallel(cfg)
        return "no error", parallel_state.model_parallel_is_initialized()
    except ConfigError as e:
        return str(e), parallel_state.model_parallel_is_initialized()


def test_world_size_not_matching_layout_is_refused():
    for msg, groups_created in run_ranks(_mismatch_worker, 3, timeout_s=300):
        assert "world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2" in msg, msg
        assert not groups_created


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "longstraw_mcore", *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)


def test_cli_config_errors_exit_2():
    r = _cli("smoke", "--config", "configs/qwen3.6-tiny.yaml", "model.bogus=1")
    assert r.returncode == 2 and "unknown config key(s) ['model.bogus']" in r.stderr, r.stderr
    r = _cli("smoke", "--config", "configs/qwen3.6-tiny.yaml", "parallel.tp=3")
    assert r.returncode == 2 and "model.num_attention_heads=4 is not divisible by parallel.tp=3" in r.stderr
