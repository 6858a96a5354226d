"""The `longstraw` command line (also `python -m longstraw_mcore`); launch under torchrun for >1 rank.

Subcommands:
  train     GRPO / DPO with branch replay: rollouts JSON Lines, N prompt groups per step, Megatron
            DDP + optimizer, a metrics line per step, checkpoints every K steps, --resume.
  validate  one branch-replay step without an optimizer update: DIR/receipt.json (+ grads.safetensors
            in Hugging Face names with --dump-grads).
  smoke     forward + backward of a next-token loss on random tokens through Megatron's pipeline
            engine (any tp/pp): loss, gradient norm, throughput, memory.
Every subcommand takes `--config CFG` and trailing `key=value` overrides (e.g. parallel.tp=2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


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
    from longstraw_mcore.pipeline import forward_backward
    from longstraw_mcore.training_utils import grad_norm, count_parameters

    m = cfg.model
    model = _build_and_load(cfg, par, args.hf, args.load, "smoke")
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


def _build_and_load(cfg, par, hf, load, log_prefix):
    from longstraw_mcore.models.qwen3_5 import build_model

    model = build_model(cfg.model, par, cfg.resolved_device())
    if hf:
        from longstraw_mcore.checkpoint.convert import load_hf_into_model

        skipped = load_hf_into_model(model, hf, expect=cfg.model)
        _rank0_print(f"[{log_prefix}] loaded {hf} (converted in memory; skipped {len(skipped)} non-decoder tensors)")
    elif load:
        from longstraw_mcore.checkpoint.dist_ckpt import load_checkpoint

        load_checkpoint(model, load)
        _rank0_print(f"[{log_prefix}] loaded Megatron checkpoint {load}")
    return model


def _prepare_replay_run(args, cmd):
    """Config + rollouts validated before any process group or model work."""
    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.data.rollouts import load_rollouts

    cfg = _load_run_config(args)
    if cfg.parallel.pp != 1:
        raise ConfigError(f"parallel.pp={cfg.parallel.pp}: `longstraw {cmd}` runs branch replay at pipeline size 1 "
                          "for now; use tensor/data parallelism")
    groups = load_rollouts(args.rollouts, cfg.model.vocab_size)
    return cfg, groups


def _ref_model(args, cfg, par):
    if not (args.ref_hf or args.ref_load):
        return None
    ref = _build_and_load(cfg, par, args.ref_hf, args.ref_load, "ref")
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def cmd_train(args) -> int:
    import json

    cfg, groups = _prepare_replay_run(args, "train")
    from longstraw_mcore.parallel.groups import setup_parallel

    par = setup_parallel(cfg)
    from longstraw_mcore.train.trainer import Trainer, build_optimizer, prune_partial, wrap_ddp

    model = _build_and_load(cfg, par, args.hf, args.load, "train")
    ddp = wrap_ddp(model, cfg, par)
    opt = build_optimizer(ddp, cfg, par)
    trainer = Trainer(cfg, par, ddp, opt, groups, ref_model=_ref_model(args, cfg, par))
    if args.resume:
        if not args.save:
            raise SystemExit("error: --resume needs --save DIR (where the checkpoints are)")
        prune_partial(args.save)
        if trainer.resume(args.save):
            _rank0_print(f"[train] resumed from {args.save} at step {trainer.step}")
    _rank0_print(f"[train] {len(groups)} prompt groups, {cfg.train.groups_per_step} per step per data-parallel rank, "
                 f"mode {cfg.replay.mode}, objective {cfg.grpo.objective}, layout tp={par.tp} dp={par.dp}, "
                 f"steps {trainer.step + 1}..{args.steps}")
    while trainer.step < args.steps:
        m = trainer.run_step()
        _rank0_print("[train] " + json.dumps(m))
        if args.metrics_out and par.rank == 0:
            with open(args.metrics_out, "a") as f:
                f.write(json.dumps(m) + "\n")
        if args.save and cfg.train.save_every and trainer.step % cfg.train.save_every == 0:
            trainer.save(args.save)
            _rank0_print(f"[train] checkpoint {args.save}/step_{trainer.step:06d}")
    if args.save and not (cfg.train.save_every and trainer.step % cfg.train.save_every == 0):
        trainer.save(args.save)
    return 0


def cmd_validate(args) -> int:
    import json

    if args.mode:
        args.overrides = list(args.overrides) + [f"replay.mode={args.mode}"]
    cfg, groups = _prepare_replay_run(args, "validate")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        from longstraw_mcore.config import ConfigError

        raise ConfigError(f"--out {out}: exists and is not empty; refusing to overwrite")
    from longstraw_mcore.parallel.groups import setup_parallel

    par = setup_parallel(cfg)
    import dataclasses

    import torch
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import peak_bytes, wrap_ddp
    from longstraw_mcore.training_utils import grad_norm

    model = _build_and_load(cfg, par, args.hf, args.load, "validate")
    ddp = wrap_ddp(model, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, distributed_optimizer=False)),
                   par)
    ref = _ref_model(args, cfg, par)
    dp_rank, n = par.pgs.dp.rank(), len(groups)
    mine = [i for i in range(n) if i % par.dp == dp_rank]
    ddp.zero_grad_buffer()
    results, seconds = {}, {}
    for i in mine:
        st = process_group(ddp, groups[i], cfg.replay, cfg.grpo, par.tp, scale=par.dp / n, ref_model=ref, index=i)
        results[i] = {"loss": st.loss, "logprobs": st.logprobs, "skipped": st.skipped, "state_bytes": st.state_bytes,
                      "ref_state_bytes": st.ref_state_bytes}
        for k, v in (st.seconds or {}).items():
            seconds[k] = seconds.get(k, 0.0) + v
        _rank0_print(f"[validate] group {i}: loss {st.loss:.6g}, {st.tokens} response tokens, "
                     f"state {st.state_bytes / 2**20:.3f} MiB")
    finalize_model_grads([ddp], pg_collection=par.pgs)
    gn = grad_norm(ddp.module, par)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (results, seconds, peak_bytes(par.device)))
    grads = None
    if args.dump_grads:
        from longstraw_mcore.checkpoint.full_state import gather_full
        from longstraw_mcore.checkpoint.qwen3_5 import mcore_to_hf

        grads = mcore_to_hf(gather_full(ddp.module, grads=True), cfg.model)
    if par.rank == 0:
        merged = {}
        for res, _, _ in gathered:
            merged.update(res)
        receipt = {
            "loss": sum(merged[i]["loss"] for i in range(n)) / n,
            "logprobs": [merged[i]["logprobs"] for i in range(n)],
            "skipped_groups": [i for i in range(n) if merged[i]["skipped"]],
            "grad_norm": gn, "mode": cfg.replay.mode, "objective": cfg.grpo.objective,
            "layout": par.layout(), "peak_bytes_per_rank": [p for _, _, p in gathered],
            "state_bytes_per_group": [merged[i]["state_bytes"] for i in range(n)],
            "ref_state_bytes_per_group": [merged[i]["ref_state_bytes"] for i in range(n)],
            "seconds": {k: max(s.get(k, 0.0) for _, s, _ in gathered) for k in gathered[0][1]},
            "config": dataclasses.asdict(cfg),
        }
        _write_outputs(out, receipt, grads)
        _rank0_print(f"[validate] loss {receipt['loss']:.6g}, grad norm {gn:.6g}, wrote {out}/receipt.json"
                     + (" and grads.safetensors" if grads is not None else ""))
    dist.barrier()
    return 0


def _write_outputs(out: Path, receipt: dict, grads) -> None:
    import json
    import os

    out.mkdir(parents=True, exist_ok=True)
    if grads is not None:
        from safetensors.torch import save_file

        tmp = out / ".grads.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in grads.items()}, str(tmp))
        os.replace(tmp, out / "grads.safetensors")
    tmp = out / ".receipt.json.tmp"
    tmp.write_text(json.dumps(receipt, indent=1))
    os.replace(tmp, out / "receipt.json")


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

    def replay_args(sp, need_weights):
        sp.add_argument("--config", default=None)
        g = sp.add_mutually_exclusive_group(required=need_weights)
        g.add_argument("--hf", default=None, help="Hugging Face directory (config.json + *.safetensors)")
        g.add_argument("--load", default=None, help="Megatron checkpoint directory")
        sp.add_argument("--rollouts", required=True, help="JSON Lines prompt groups")
        r = sp.add_mutually_exclusive_group()
        r.add_argument("--ref-hf", default=None, help="reference model (HF dir) for the KL term")
        r.add_argument("--ref-load", default=None, help="reference model (Megatron checkpoint)")
        sp.add_argument("overrides", nargs="*", help="key=value config overrides")

    t = sub.add_parser("train", help="GRPO/DPO training with branch replay")
    replay_args(t, need_weights=False)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--save", default=None, help="checkpoint directory")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --save")
    t.add_argument("--metrics-out", default=None, help="append one JSON line of metrics per step (rank 0)")
    t.set_defaults(func=cmd_train)
    v = sub.add_parser("validate", help="one branch-replay step without an optimizer update")
    replay_args(v, need_weights=True)
    v.add_argument("--out", required=True)
    v.add_argument("--mode", choices=["detached", "exact"], default=None)
    v.add_argument("--dump-grads", action="store_true")
    v.set_defaults(func=cmd_validate)
    return p


def main(argv=None) -> int:
    import warnings

    # Megatron warns at import that TE / apex / absl are absent; on CPU that is the expected set-up.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    args = build_parser().parse_args(argv)
    from longstraw_mcore.checkpoint.qwen3_5 import CheckpointError
    from longstraw_mcore.config import ConfigError

    from longstraw_mcore.data.rollouts import RolloutError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, RolloutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
