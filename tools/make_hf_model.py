#!/usr/bin/env python
"""Write a Hugging Face directory (config.json + model.safetensors) of a config's model with seeded
random weights, built on the CPU whatever the machine: the same weights for a CPU run and a GPU run
to compare (scripts/gpu_check.sh), without needing `transformers`.

  python tools/make_hf_model.py OUT_DIR [--config configs/qwen3.6-tiny.yaml] [--seed 0] [--head HEAD] [key=value ...]

--head token_value: a critic (`score` [1, H] + bias in place of lm_head; the token-classification
layout with one label); sequence_score: a reward model (`score` without a bias): checkpoint/heads.py.

Weights: Megatron's initialisation on the CPU, then every vector (norm weights, A_log, dt_bias) and every
matrix that starts constant (GLM-5.3-Flash's pool gate) moved by ~0.1 so no tensor is a constant.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--config", default="configs/qwen3.6-tiny.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head", default="lm", choices=["lm", "token_value", "sequence_score"])
    p.add_argument("overrides", nargs="*")
    a = p.parse_intermixed_args(argv)

    from longstraw_mcore.cli import quiet_expected_warnings

    quiet_expected_warnings()  # (the CLI's: Megatron's absent-TE/apex notes and the like)
    import torch

    from longstraw_mcore.checkpoint.full_state import gather_full
    from longstraw_mcore.checkpoint.hf import write_hf
    from longstraw_mcore.config import load_config
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel

    cfg = load_config(a.config, list(a.overrides) + ["device=cpu", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1",
                                                     "parallel.ep=1", "parallel.pp_layers=null", f"seed={a.seed}"])
    par = setup_parallel(cfg)
    fam = get_family(cfg.model.family)
    model = fam.build_model(cfg.model, par, "cpu", head=a.head)
    gen = torch.Generator().manual_seed(a.seed + 1)
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() == 1 or bool((prm == prm.flatten()[0]).all()):  # vectors, and constant matrices
                prm.add_((0.1 * torch.randn(prm.shape, generator=gen, dtype=torch.float64)).to(prm.dtype))
    from longstraw_mcore.checkpoint import heads

    mapping = heads.mapping(fam.checkpoint, a.head)
    hf = mapping.mcore_to_hf(gather_full(model), cfg.model)
    write_hf(a.out, hf, mapping.hf_config_dict(cfg.model))
    print(f"wrote {len(hf)} tensors ({sum(t.numel() for t in hf.values()) / 1e6:.3f} M parameters, "
          f"{cfg.model.dtype}) to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
