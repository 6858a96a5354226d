"""`longstraw smoke`: forward + backward of a next-token loss on random tokens through Megatron's
pipeline engine (any tp/pp/vpp): loss, gradient norm, throughput, memory. The first thing to run on a
new machine or cluster. Interleaved stages (parallel.vpp > 1) take their micro-batches pp at a time and
need more of them than the warm-up: a step runs at least the fewest it takes (--micro-batches raises it)."""

from __future__ import annotations

import time

from longstraw_mcore.commands.common import MetricsFile, build_and_load, launch_world_size, load_run_config, rank0_print
from longstraw_mcore.commands.preflight import check_run


def run(args) -> int:
    import math

    cfg = load_run_config(args)
    check_run(cfg, "smoke", launch_world_size())
    if args.micro_batches < 1:
        from longstraw_mcore.config import ConfigError

        raise ConfigError(f"--micro-batches {args.micro_batches}: micro-batches per step, >= 1")
    import torch

    from longstraw_mcore.parallel.groups import setup_parallel

    t0 = time.perf_counter()
    par = setup_parallel(cfg)
    from longstraw_mcore.bench.memory import peak_bytes
    from longstraw_mcore.loss.logprobs import vocab_parallel_logprobs
    from longstraw_mcore.parallel.reduce import all_reduce_sum, count_parameters, grad_norm
    from longstraw_mcore.replay.pipeline import forward_backward

    m = cfg.model
    model = build_and_load(cfg, par, args.hf, args.load, "smoke")
    n_params = count_parameters(model, par)
    rank0_print(f"[smoke] {m.family}: {m.describe()}, {n_params / 1e6:.3f} M parameters, dtype {m.dtype}, vocabulary {m.vocab_size} "
                f"(padded to {m.padded_vocab_size(par.tp)})")
    rank0_print(f"[smoke] layout tp={par.tp} pp={par.pp}{f' vpp={cfg.parallel.vpp}' if cfg.parallel.vpp > 1 else ''} "
                f"cp={par.cp} dp={par.dp} on {par.world_size} "
                f"{par.device.type} rank(s) ({'gloo' if par.device.type == 'cpu' else 'nccl'}); "
                f"set-up {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator().manual_seed(cfg.seed + par.pgs.dp.rank())
    from longstraw_mcore.replay.plan import interleaved_padding

    micro = args.micro_batches + interleaved_padding(args.micro_batches, par.pp, cfg.parallel.vpp, forward_only=False)
    tokens_per_step = micro * args.batch * args.seq_len * par.dp
    if micro > args.micro_batches:
        rank0_print(f"[smoke] parallel.vpp={cfg.parallel.vpp}: {micro} micro-batches per step (the fewest the "
                    "interleaved schedule takes)")
    metrics = MetricsFile(args.metrics_out) if args.metrics_out and par.rank == 0 else None
    for step in range(1, args.steps + 1):
        ids = [torch.randint(0, m.vocab_size, (args.batch, args.seq_len + 1), generator=gen) for _ in range(micro)]
        targets = iter([x[:, 1:].to(par.device) for x in ids])  # (the schedule runs the last stage in order)

        def loss_fn(logits_local):
            loss = -vocab_parallel_logprobs(logits_local, next(targets), par.pgs.tp, m.vocab_size).mean()
            return loss, {"loss": loss.detach().clone()}

        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        out = forward_backward(model, par, [x[:, :-1].contiguous() for x in ids], loss_fn)
        gn = grad_norm(model, par)
        dt = time.perf_counter() - t
        peak = peak_bytes(par.device)
        loss = all_reduce_sum([sum(float(o["loss"]) for o in out) / micro], par.pgs.dp,
                              par.device)[0] / par.dp  # mean over micro-batches and replicas
        rank0_print(f"[smoke] step {step}/{args.steps}: loss {loss:.4f} (ln V = {math.log(m.vocab_size):.4f}), grad "
                    f"norm {gn:.4f}, {tokens_per_step} tokens in {dt:.2f} s ({tokens_per_step / dt:,.0f} tokens/s "
                    f"fwd+bwd), peak {peak / 2**30:.2f} GiB/rank")
        if metrics is not None:
            metrics.append({"step": step, "loss": loss, "grad_norm": gn, "micro_batches": micro,
                            "tokens": tokens_per_step, "seconds": dt, "tokens_per_s": tokens_per_step / dt,
                            "peak_bytes_rank0": peak})
    rank0_print("[smoke] done: forward + backward ran through Megatron's pipeline engine on every rank")
    return 0
