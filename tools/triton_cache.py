#!/usr/bin/env python
"""The GPU check's side of a carried Triton kernel archive (issue 58; ops/triton_cache.py has the contract).

  python tools/triton_cache.py unpack ARCHIVE [--cache DIR]      verify (Triton's key, the path) and unpack;
                                                                 a mismatch: one line, exit 3, nothing unpacked
  python tools/triton_cache.py inventory DIR > before.json       what a cache holds now
  python tools/triton_cache.py since before.json DIR             "compiled N kernels (names), benchmarked M"
  python tools/triton_cache.py harvest before.json DIR OUT       copy what this machine added into OUT/

`since` prints one short line for the check's summary; `harvest` brings the device's own compiles and autotune
records back in $OUT, so they can be committed (bench_results/<date>_autotune/) and pinned by the next build.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longstraw_mcore.ops import triton_cache  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack")
    u.add_argument("archive", type=Path)
    u.add_argument("--cache", default=triton_cache.FIXED_CACHE_DIR)
    i = sub.add_parser("inventory")
    i.add_argument("cache")
    s = sub.add_parser("since")
    s.add_argument("before", type=Path)
    s.add_argument("cache")
    h = sub.add_parser("harvest")
    h.add_argument("before", type=Path)
    h.add_argument("cache")
    h.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "unpack":
        if not a.archive.is_file():
            print(f"[triton_cache] no archive at {a.archive}: every kernel compiles on first use")
            return 3
        manifest, found = triton_cache.unpack(a.archive, a.cache)
        if found:
            print(f"[triton_cache] {a.archive.name} refused: {'; '.join(found)}")
            return 3
        print(f"[triton_cache] {manifest['kernels']} kernels, {manifest['autotune_records']} autotune records "
              f"({manifest.get('mode')}) unpacked into {a.cache}")
        return 0
    if a.cmd == "inventory":
        print(json.dumps(triton_cache.inventory(a.cache)))
        return 0
    before = json.loads(a.before.read_text()) if a.before.is_file() else {}
    if a.cmd == "since":
        fresh = triton_cache.new_since(before, a.cache)
        names = sorted(set(fresh["kernels"].values()))
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        print(f"compiled {len(fresh['kernels'])}{f' ({shown})' if names else ''}, "
              f"benchmarked {len(fresh['autotune'])}")
        return 0
    counts = triton_cache.harvest(before, a.cache, a.out)
    print(f"[triton_cache] harvested {counts['kernels']} kernels and {counts['autotune']} autotune records into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
