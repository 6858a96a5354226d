"""The `longstraw` command line (also `python -m longstraw_mcore`); launch under torchrun for >1 rank.

Subcommands so far:
  smoke   build the model for the configured layout, optionally load weights (--hf DIR | --load DIR),
          run forward + backward of a next-token loss on random tokens through Megatron's pipeline
          engine, and report loss, gradient norm, throughput and memory (rank 0 prints).
Every subcommand takes `--config CFG` and trailing `key=value` overrides (e.g. parallel.tp=2).
"""

from __future__ import annotations

import argparse
import sys
import time


def _rank0_print(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _load_run_config(args):
    from longstraw_mcore.config import load_config

    base = None
    if args.config is None:
        if getattr(args, "hf", None) is None:
            raise SystemExit("error: give --config CFG (or --hf DIR, whose config.json defines the model)")
        import dataclasses

        from longstraw_mcore.checkpoint.hf import read_config

        m, _ = read_config(args.hf)
        base = {"model": dataclasses.asdict(m)}
    return load_config(args.config, args.overrides, base=base)


def cmd_smoke(args) -> int:
    import torch
    import torch.distributed as dist

    cfg = _load_run_config(args)
    from longstraw_mcore.parallel.groups import setup_parallel

    t0 = time.perf_counter()
    par = setup_parallel(cfg)
    from longstraw_mcore.loss.logprobs import vocab_parallel_logprobs
    from longstraw_mcore.models.qwen3_5 import build_model
    from longstraw_mcore.pipeline import forward_backward
    from longstraw_mcore.training_utils import grad_norm, count_parameters

    m = cfg.model
    model = build_model(m, par, cfg.resolved_device())
    if args.hf:
        from longstraw_mcore.checkpoint.convert import load_hf_into_model

        skipped = load_hf_into_model(model, args.hf, expect=m)
        _rank0_print(f"[smoke] loaded {args.hf} (converted in memory; skipped {len(skipped)} non-decoder tensors)")
    elif args.load:
        from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint

        load_checkpoint(model, args.load)
        _rank0_print(f"[smoke] loaded Megatron checkpoint {args.load}")
    n_params = count_parameters(model, par)
    _rank0_print(f"[smoke] {m.family}: {m.num_layers} layers ({m.layer_types.count('linear_attention')} Gated "
                 f"DeltaNet + {m.layer_types.count('full_attention')} gated attention), hidden {m.hidden_size}, "
                 f"{n_params / 1e6:.3f} M parameters, dtype {m.dtype}")
    _rank0_print(f"[smoke] layout tp={par.tp} pp={par.pp} cp={par.cp} dp={par.dp} on {par.world_size} "
                 f"{cfg.resolved_device()} rank(s) ({'gloo' if par.device.type == 'cpu' else 'nccl'}); "
                 f"set-up {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator().manual_seed(cfg.seed + par.rank // (par.tp * par.pp))
    tokens_per_step = args.batch * args.seq_len * par.dp
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, m.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].to(par.device)

        def loss_fn(logits_local):
            loss = -vocab_parallel_logprobs(logits_local, targets, par.pgs.tp).mean()
            return loss, {"loss": loss.detach().clone()}

        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        out = forward_backward(model, par, [inputs], loss_fn)
        gn = grad_norm(model, par)
        dt = time.perf_counter() - t
        loss = float(out[0]["loss"])
        if dist.is_initialized() and par.dp > 1:
            lt = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(lt)
            loss = float(lt) / par.world_size * (par.tp * par.pp)
        _rank0_print(f"[smoke] step {step}/{args.steps}: loss {loss:.4f} (ln V = "
                     f"{torch.log(torch.tensor(float(m.vocab_size))):.4f}), grad norm {gn:.4f}, "
                     f"{tokens_per_step} tokens in {dt:.2f} s ({tokens_per_step / dt:,.0f} tokens/s fwd+bwd), "
                     f"peak RSS {_peak_rss_gib():.2f} GiB/rank")
    _rank0_print("[smoke] done: forward + backward ran through Megatron's pipeline engine on every rank")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longstraw", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("smoke", help="forward + backward of the model on random tokens")
    s.add_argument("--config", default=None)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--hf", default=None, help="Hugging Face directory to load weights from")
    g.add_argument("--load", default=None, help="Megatron checkpoint directory to load weights from")
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--seq-len", type=int, default=64)
    s.add_argument("--steps", type=int, default=2)
    s.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. parallel.tp=2")
    s.set_defaults(func=cmd_smoke)
    return p


def main(argv=None) -> int:
    import warnings

    # Megatron warns at import that TE / apex / absl are absent; on CPU that is the expected set-up.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    args = build_parser().parse_args(argv)
    from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError
    from longstraw_mcore.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
