"""A Triton kernel cache built on one machine and used on another: its manifest, the checks a device makes
before trusting it, and the inventory that tells what a device compiled or autotuned on its own.

Triton finds a compiled kernel by a hash of (its own key: Triton's sources + libtriton, the kernel's source and
specialisation, the backend: ptxas version + arch, the options, the cache-invalidating `TRITON_*` variables)
under `TRITON_CACHE_DIR`. Two traps make a carried cache miss *silently*: another Triton build (another key)
and another directory (each kernel's `__grp__*.json` lists its files by absolute path, and Triton drops the
entries whose path does not exist). So an archive is built and used at one fixed path (`FIXED_CACHE_DIR`),
and `problems()` names either mismatch in one line before anything is unpacked.

Layout of an archive (`pack`): `manifest.json` + `cache/<entry>/...` (Triton's cache entries, binary only).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
from pathlib import Path

FIXED_CACHE_DIR = "/tmp/longstraw-triton-sm90"
MANIFEST = "manifest.json"


def triton_identity() -> dict:
    """What must match for a carried cache to hit: Triton's version and `sha256(triton_key())[:16]`."""
    import triton
    from triton.runtime.cache import triton_key

    return {"triton": triton.__version__, "triton_key": hashlib.sha256(triton_key().encode()).hexdigest()[:16]}


def inventory(cache_dir: str | Path) -> dict:
    """{"kernels": {entry: kernel name}, "autotune": {entry: kernel name}, "bytes": total} of a cache dir: a
    kernel entry holds a `.cubin`, an autotune entry a `<kernel>.autotune.json` (the device's benchmark result)."""
    kernels, autotune, total = {}, {}, 0
    root = Path(cache_dir)
    if not root.is_dir():
        return {"kernels": kernels, "autotune": autotune, "bytes": 0}
    for entry in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in entry.iterdir():
            total += f.stat().st_size
            if f.suffix == ".cubin":
                kernels[entry.name] = f.stem
            elif f.name.endswith(".autotune.json"):
                autotune[entry.name] = f.name[: -len(".autotune.json")]
    return {"kernels": kernels, "autotune": autotune, "bytes": total}


def new_since(before: dict, cache_dir: str | Path) -> dict:
    """The entries of `cache_dir` not in the inventory `before`: what this machine compiled (kernels) and
    benchmarked (autotune) itself."""
    now = inventory(cache_dir)
    return {k: {e: n for e, n in now[k].items() if e not in before.get(k, {})} for k in ("kernels", "autotune")}


def make_manifest(cache_dir: str | Path, **extra) -> dict:
    inv = inventory(cache_dir)
    return {**triton_identity(), "cache_dir": str(Path(cache_dir).resolve()), "arch": "sm_90",
            "kernels": len(inv["kernels"]), "autotune_records": len(inv["autotune"]), "bytes": inv["bytes"],
            "kernel_names": sorted(set(inv["kernels"].values())), **extra}


def problems(manifest: dict, cache_dir: str | Path) -> list[str]:
    """Why the archive described by `manifest` would not hit in `cache_dir` with this Triton (empty: usable)."""
    out = []
    here = triton_identity()
    if manifest.get("triton_key") != here["triton_key"]:
        out.append(f"built with triton {manifest.get('triton')} (key {manifest.get('triton_key')}), this is triton "
                   f"{here['triton']} (key {here['triton_key']}): every kernel would be compiled again")
    if str(Path(cache_dir).resolve()) != manifest.get("cache_dir"):
        out.append(f"built at {manifest.get('cache_dir')}, used at {Path(cache_dir).resolve()}: Triton's group files "
                   "name absolute paths, so every kernel would miss (use the build's path)")
    return out


def pack(cache_dir: str | Path, archive: str | Path, manifest: dict) -> dict:
    """Write `archive` (.tar.xz) atomically: the manifest, then every cache entry. Returns its size."""
    archive = Path(archive)
    tmp = archive.with_name(archive.name + ".part")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        tar.add(str(cache_dir), arcname="cache")
    os.replace(tmp, archive)
    return {"archive_bytes": archive.stat().st_size}


def read_manifest(archive: str | Path) -> dict:
    with tarfile.open(archive, "r:xz") as tar:
        member = tar.next()
        if member is None or member.name != MANIFEST:
            raise ValueError(f"{archive}: not a kernel archive (its first member is not {MANIFEST})")
        return json.loads(tar.extractfile(member).read())


def unpack(archive: str | Path, cache_dir: str | Path = FIXED_CACHE_DIR) -> tuple[dict, list[str]]:
    """Unpack `archive` into `cache_dir` if `problems()` finds none; returns (manifest, problems). Nothing
    is unpacked when there is a problem (the caller compiles as if there were no archive)."""
    manifest = read_manifest(archive)
    found = problems(manifest, cache_dir)
    if found:
        return manifest, found
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        for m in tar.getmembers():
            if m.name == MANIFEST or not m.name.startswith("cache/") or not (m.isfile() or m.isdir()):
                continue
            rel = Path(m.name).relative_to("cache")
            if ".." in rel.parts:
                raise ValueError(f"{archive}: member {m.name!r} leaves the cache directory")
            if m.isfile():
                dest = cache_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    return manifest, []


def harvest(before: dict, cache_dir: str | Path, out: str | Path) -> dict:
    """Copy what this machine added to `cache_dir` since `before` into `out/kernels/<entry>/` (kernels it
    compiled) and `out/autotune/<entry>/` (autotune records it benchmarked: `ops.triton_aot.load_winners`
    reads them), Triton's layout, so a later build can take them. Returns the counts."""
    fresh = new_since(before, cache_dir)
    out = Path(out)
    for kind in ("kernels", "autotune"):
        for entry in fresh[kind]:
            shutil.copytree(Path(cache_dir) / entry, out / kind / entry, dirs_exist_ok=True)
    return {k: len(v) for k, v in fresh.items()}
