"""`longstraw check`: the preflight of a subcommand alone, without starting anything: the config (and
overrides) for that subcommand at a world size, and optionally a rollouts file. Launch scripts call
it before they allocate a cluster's worth of processes; tests run it on every config and launch line."""

from __future__ import annotations

from longstraw_mcore.commands.common import load_run_config
from longstraw_mcore.commands.preflight import check_groups, check_run


def check_hf_matches(hf: str, cfg) -> int:
    """--config and --hf together: the directory's config.json describes the config's model (run settings
    such as the dtype aside: weights are cast on load) and the directory holds weights; returns the
    number of safetensors files."""
    from pathlib import Path

    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.families import read_hf_config

    theirs, _ = read_hf_config(hf)
    mine, other = cfg.model.architecture(), theirs.architecture()
    differ = [k for k in mine if mine[k] != other.get(k)]
    if differ:
        shown = ", ".join(f"{k}: config {mine[k]!r}, {hf} {other.get(k)!r}" for k in differ[:4])
        raise ConfigError(f"--hf {hf} does not hold the config's model ({len(differ)} field(s) differ: {shown}); "
                          "give the matching --config, or --hf alone (its config.json then defines the model)")
    files = sorted(Path(hf).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--hf {hf}: no *.safetensors files (a config.json alone has no weights)")
    return len(files)


def run(args) -> int:
    cfg = load_run_config(args)
    dp = check_run(cfg, args.cmd, args.world_size)
    shards = check_hf_matches(args.hf, cfg) if args.hf is not None else None
    m, p = cfg.model, cfg.parallel
    line = (f"[check] ok: `longstraw {args.cmd}` with {m.family} ({m.num_layers} layers, dtype {m.dtype}, vocabulary "
            f"{m.vocab_size} padded to {m.padded_vocab_size(p.tp)}), layout tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep}")
    if dp is not None:
        line += f" dp={dp} on {args.world_size} ranks"
    if shards is not None:
        line += f"; --hf {args.hf}: the same model, {shards} safetensors file(s)"
    if args.rollouts:
        from longstraw_mcore.data.rollouts import load_rollouts

        groups = load_rollouts(args.rollouts, m.vocab_size)
        check_groups(cfg, groups, has_ref_model=args.with_ref_model)
        line += f"; {len(groups)} rollout groups valid for grpo.objective={cfg.grpo.objective}"
    print(line, flush=True)
    return 0
