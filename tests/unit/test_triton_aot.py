"""Hopper kernels built on a CPU machine and found again as a device would find them (issue 58).

One project kernel (the DSA indexer's scores, a plain @triton.jit) and one of fla's (its l2norm forward, an
autotuned kernel) compile for sm_90 under `ops.triton_aot.OfflineHopper` in pinned mode into a temporary cache;
then a fresh process (another hash seed, another working directory) takes the same calls the device's way,
Triton's own autotuner reading the pinned record, and compiles nothing. A cache carried to another path, or
built by another Triton, is refused with one line and nothing is unpacked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla", reason="fla-core (the test extra) is not installed")

ROOT = Path(__file__).resolve().parents[2]

CALLS = r"""
import json, sys, torch
from longstraw_mcore.ops import triton_aot
with triton_aot.OfflineHopper(sys.argv[1]) as aot:
    from longstraw_mcore.ops import dsa_triton_indexer
    from fla.modules.l2norm import l2norm_fwd
    g = torch.Generator().manual_seed(0)
    T, S, HI, DI, k = 16, 40, 4, 8, 8
    dsa_triton_indexer.indexer_topk(torch.randn(1, T, HI, DI, generator=g), torch.randn(1, S, DI, generator=g),
                                    torch.randn(1, T, HI, generator=g), torch.arange(S - T, S), torch.arange(S), k)
    l2norm_fwd(torch.randn(64, 128, generator=g))
print(json.dumps([dict(kernel=r.kernel, hit=r.cache_hit) for r in aot.records]))
"""


def _run(mode: str, cache: Path, cwd: Path, seed: str, **env) -> list[dict]:
    e = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT), **env)
    for k in ("TRITON_INTERPRET", "TRITON_CACHE_AUTOTUNING"):
        e.pop(k, None)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", CALLS, mode], cwd=cwd, env=e, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernels_built_offline_are_found_again_and_a_moved_cache_is_refused(tmp_path):
    from longstraw_mcore.ops import triton_cache

    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    built = _run("pinned", cache, tmp_path / "a", "1")
    names = {r["kernel"] for r in built if not r["hit"]}
    assert names == {"_scores_kernel", "l2norm_fwd_kernel"}, built
    inv = triton_cache.inventory(cache)
    assert len(inv["kernels"]) == sum(not r["hit"] for r in built) and list(inv["autotune"].values()) == ["l2norm_fwd_kernel"], inv

    from longstraw_mcore.ops import triton_aot

    winners = triton_aot.load_winners(cache)  # (the records a device brings back read the same way)
    assert [k[0] for k in winners] == ["l2norm_fwd_kernel"] and "num_warps" in next(iter(winners.values())), winners

    again = _run("check", cache, tmp_path / "b", "2", TRITON_CACHE_AUTOTUNING="1")
    assert [r["kernel"] for r in again] == [r["kernel"] for r in built]
    assert all(r["hit"] for r in again), f"a fresh process compiled again: {again}"
    assert triton_cache.new_since(inv, cache) == {"kernels": {}, "autotune": {}}
    # what a device adds is brought back in Triton's layout, and read as winners again
    assert triton_cache.harvest({}, cache, tmp_path / "back") == {"kernels": len(inv["kernels"]), "autotune": 1}
    assert triton_aot.load_winners(tmp_path / "back" / "autotune") == winners

    archive = tmp_path / "k.tar.xz"
    triton_cache.pack(cache, archive, triton_cache.make_manifest(cache, mode="pinned"))
    elsewhere = tmp_path / "elsewhere"
    r = subprocess.run([sys.executable, str(ROOT / "tools/triton_cache.py"), "unpack", str(archive), "--cache",
                        str(elsewhere)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and len(r.stdout.strip().splitlines()) == 1, r.stdout + r.stderr
    assert "absolute paths" in r.stdout and str(cache) in r.stdout, r.stdout
    assert not elsewhere.exists()

    manifest, found = triton_cache.unpack(archive, cache)
    assert found == [] and manifest["kernels"] == len(inv["kernels"])
    other = dict(manifest, triton_key="0" * 16, triton="0.0")
    found = triton_cache.problems(other, cache)
    assert len(found) == 1 and "compiled again" in found[0] and "0.0" in found[0], found
