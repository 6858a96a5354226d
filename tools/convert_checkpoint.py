#!/usr/bin/env python
"""Convert between a Hugging Face Qwen3.5/3.6 directory and a Megatron distributed checkpoint.

  python tools/convert_checkpoint.py hf-to-mcore SRC_HF_DIR DST_MCORE_DIR [--tp N --pp N]
  python tools/convert_checkpoint.py mcore-to-hf SRC_MCORE_DIR DST_HF_DIR

The Megatron checkpoint is layout-free (it loads at any tp/pp); --tp/--pp check that the target
layout divides the model before anything is written. HF -> Megatron -> HF is bit-exact.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--ep", type=int, default=1)
    b = sub.add_parser("mcore-to-hf")
    b.add_argument("src")
    b.add_argument("dst")
    args = p.parse_args(argv)

    from longstraw_mcore.checkpoint.common import CheckpointError
    from longstraw_mcore.config import ConfigError

    try:
        if args.cmd == "hf-to-mcore":
            from longstraw_mcore.checkpoint.convert import hf_to_mcore_dir
            from longstraw_mcore.families import family_of_dir

            hf_to_mcore_dir(family_of_dir(args.src), args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep)
        else:
            from longstraw_mcore.checkpoint.convert import mcore_to_hf_dir
            from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta
            from longstraw_mcore.families import get_family

            mcore_to_hf_dir(get_family(read_checkpoint_meta(args.src)[0].family), args.src, args.dst)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # guarded: Megatron's checkpoint writer re-imports __main__
    sys.exit(main())
