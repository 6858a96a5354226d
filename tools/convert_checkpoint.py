#!/usr/bin/env python
"""Convert between a Hugging Face directory (any supported family) and a Megatron distributed
checkpoint; export a LoRA training checkpoint's adapter as a PEFT directory, or merged into the base.

  python tools/convert_checkpoint.py hf-to-mcore SRC_HF_DIR DST_MCORE_DIR [--tp N --pp N --ep N]
  python tools/convert_checkpoint.py mcore-to-hf SRC_MCORE_DIR DST_HF_DIR
  python tools/convert_checkpoint.py adapter-export STEP_DIR DST_PEFT_DIR [--base HF_DIR]
  python tools/convert_checkpoint.py adapter-export STEP_DIR DST_HF_DIR --merge --base HF_DIR

STEP_DIR: a `train --save` step directory of an adapter run (or any PEFT directory). Without --merge
the export is what `peft` loads (`PeftModel.from_pretrained`); with it, a Hugging Face model whose
projections hold W + (alpha / r) B A.

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
    c = sub.add_parser("adapter-export")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--base", default=None, help="the base Hugging Face directory (needed with --merge)")
    c.add_argument("--merge", action="store_true")
    args = p.parse_args(argv)

    from longstraw_mcore.cli import quiet_expected_warnings

    quiet_expected_warnings()  # (the CLI's: Megatron's absent-TE/apex notes and the like)
    from longstraw_mcore.checkpoint.common import CheckpointError
    from longstraw_mcore.config import ConfigError

    try:
        if args.cmd == "hf-to-mcore":
            from longstraw_mcore.checkpoint.convert import hf_to_mcore_dir
            from longstraw_mcore.families import family_of_dir

            hf_to_mcore_dir(family_of_dir(args.src), args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep)
        elif args.cmd == "adapter-export":
            _adapter_export(args)
        else:
            from longstraw_mcore.checkpoint.convert import mcore_to_hf_dir
            from longstraw_mcore.checkpoint.dist_ckpt import read_checkpoint_meta
            from longstraw_mcore.families import get_family

            mcore_to_hf_dir(get_family(read_checkpoint_meta(args.src)[0].family), args.src, args.dst)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _adapter_export(args) -> None:
    from pathlib import Path

    from longstraw_mcore.config import ConfigError

    src = Path(args.src)
    src = src / "adapter" if (src / "adapter" / "adapter_config.json").is_file() else src
    if args.merge:
        if args.base is None:
            raise ConfigError("adapter-export --merge needs --base HF_DIR (the model the adapter was trained on)")
        from longstraw_mcore.adapters.merge import merge_into_hf
        from longstraw_mcore.families import family_of_dir

        merge_into_hf(family_of_dir(args.base), args.base, src, args.dst)
        return
    from longstraw_mcore.adapters.peft_io import export_peft

    export_peft(src, args.dst, args.base)


if __name__ == "__main__":  # guarded: Megatron's checkpoint writer re-imports __main__
    sys.exit(main())
