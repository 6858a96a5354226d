"""`longstraw check`: the preflight of a subcommand alone, without starting anything: the config (and
overrides) for that subcommand at a world size, and optionally a rollouts file. Launch scripts call
it before they allocate a cluster's worth of processes; tests run it on every config and launch line."""

from __future__ import annotations

from longstraw_mcore.commands.common import load_run_config
from longstraw_mcore.commands.preflight import check_groups, check_run


def run(args) -> int:
    cfg = load_run_config(args)
    dp = check_run(cfg, args.cmd, args.world_size)
    m, p = cfg.model, cfg.parallel
    line = (f"[check] ok: `longstraw {args.cmd}` with {m.family} ({m.num_layers} layers, dtype {m.dtype}, vocabulary "
            f"{m.vocab_size} padded to {m.padded_vocab_size(p.tp)}), layout tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep}")
    if dp is not None:
        line += f" dp={dp} on {args.world_size} ranks"
    if args.rollouts:
        from longstraw_mcore.data.rollouts import load_rollouts

        groups = load_rollouts(args.rollouts, m.vocab_size)
        check_groups(cfg, groups, has_ref_model=args.with_ref_model)
        line += f"; {len(groups)} rollout groups valid for grpo.objective={cfg.grpo.objective}"
    print(line, flush=True)
    return 0
