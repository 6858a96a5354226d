"""`longstraw validate`: one branch-replay step without an optimizer update. Writes DIR/receipt.json
(loss, per-token log-probs, grad norm, mode, layout, peak bytes, seconds per phase, the kernels each op
ran: `kernels`, {op: {kernel: calls summed over ranks}}, ops/dispatch.py) and, with
--dump-grads, DIR/grads.safetensors: full gradients under Hugging Face names, true vocabulary,
streamed to rank 0 one mapping rule at a time."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from longstraw_mcore.commands.common import (build_and_load, launch_world_size, load_run_config, rank0_print,
                                             reference_model, resolve_adapter, trained_description)
from longstraw_mcore.commands.preflight import check_fits, check_groups, check_run
from longstraw_mcore.families import get_family


def run(args) -> int:
    from longstraw_mcore.config import ConfigError
    from longstraw_mcore.data.rollouts import load_rollouts

    if args.mode:
        args.overrides = list(args.overrides) + [f"replay.mode={args.mode}"]
    cfg, adapter = resolve_adapter(args, load_run_config(args))
    check_run(cfg, "validate", launch_world_size())
    groups = load_rollouts(args.rollouts, cfg.model.vocab_size)
    check_groups(cfg, groups, has_ref_model=bool(args.ref_hf or args.ref_load))
    from longstraw_mcore.commands.critic import critic_config, reward_config

    ccfg = critic_config(cfg, args.critic, args.critic_adapter)
    mcfg = reward_config(cfg, args.reward_model)
    check_fits(cfg, groups, launch_world_size(), args.force, "validate")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty directory; refusing to overwrite")

    from longstraw_mcore.parallel.groups import setup_parallel

    par = setup_parallel(cfg)
    import torch.distributed as dist

    from longstraw_mcore.bench.memory import peak_since_reset, reset_peak

    baseline = reset_peak(par.device)  # the process before the model: Python, torch, Megatron
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.parallel.reduce import grad_norm
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.bench.memory import peak_bytes
    from longstraw_mcore.train.trainer import wrap_ddp_no_optimizer

    from longstraw_mcore.commands.layer_probe import LayerProbe, merge_reports

    model = build_and_load(cfg, par, args.hf, args.load, "validate", adapter)
    rank0_print(f"[validate] {cfg.model.family}: {cfg.model.describe()}; layout {par.layout()}")
    probe = LayerProbe(model, cfg.model, par.ep)
    ddp = wrap_ddp_no_optimizer(model, cfg, par)
    ref = reference_model(args, cfg, par)
    critic = scores = None
    if mcfg is not None:  # a learned reward in place of the rollouts' rewards (every rank scores every group)
        from longstraw_mcore.commands.critic import build_second
        from longstraw_mcore.replay.reward_model import reward_scores

        scores = reward_scores(build_second(mcfg, par, args.reward_model, "reward", trainable=False), groups,
                               cfg.replay)
        groups = [dataclasses.replace(g, rewards=sc) for g, sc in zip(groups, scores)]
    if ccfg is not None:
        from longstraw_mcore.commands.critic import build_second

        critic = wrap_ddp_no_optimizer(build_second(ccfg, par, args.critic, "critic", trainable=True, policy=model,
                                                    adapter_path=args.critic_adapter), ccfg, par)
        critic.zero_grad_buffer()
    dp_rank, n = par.pgs.dp.rank(), len(groups)
    ddp.zero_grad_buffer()
    results, seconds = {}, {}
    from longstraw_mcore.replay.watch import Watch

    watch = Watch(rank0_print if par.rank == 0 else None, cfg.replay.progress_every_s)  # progress only
    from longstraw_mcore.ops import dispatch

    dispatch.reset_kernels()
    from functools import partial

    if critic is not None:
        from longstraw_mcore.replay.ppo_step import process_ppo_group

        step = partial(process_ppo_group, ddp, critic, pcfg=cfg.ppo)
    else:
        step = partial(process_group, ddp)
    for i, stand_in in _slots(n, par.dp, dp_rank, par.ep):
        if stand_in:  # (expert parallelism: its all-to-alls need this rank; the group's gradient counts 0 times)
            step(groups[i], rcfg=cfg.replay, gcfg=cfg.grpo, scale=0.0, ref_model=ref, index=i)
            continue
        st = step(groups[i], rcfg=cfg.replay, gcfg=cfg.grpo, scale=par.dp / n, ref_model=ref, index=i, watch=watch)
        results[i] = {"loss": st.loss, "logprobs": st.logprobs, "skipped": st.skipped, "state_bytes": st.state_bytes,
                      "ref_state_bytes": st.ref_state_bytes, "tokens": st.tokens, "replayed": st.replayed_tokens,
                      "seconds": dict(st.seconds or {})}
        if critic is not None:
            results[i].update(value_loss=st.value_loss, values=st.values, advantages=st.advantages, returns=st.returns,
                              critic_state_bytes=st.critic_state_bytes)
        for k, v in (st.seconds or {}).items():
            seconds[k] = seconds.get(k, 0.0) + v
        rank0_print(f"[validate] group {i}: loss {st.loss:.6g}, {st.tokens} response tokens ({st.replayed_tokens} "
                    "replayed), "
                    f"state {st.state_bytes / 2**20:.3f} MiB on rank 0")
    probe.close()
    from longstraw_mcore.models.chunks import chunk_list

    finalize_model_grads(chunk_list(ddp), pg_collection=par.pgs)  # (parallel.vpp > 1: every chunk's DDP)
    gn = grad_norm(ddp.module, par)
    if critic is not None:
        finalize_model_grads([critic], pg_collection=par.pgs)
        critic_gn = grad_norm(critic.module, par)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (results, seconds, peak_bytes(par.device), probe.report(),
                                      peak_since_reset(par.device) - baseline, dispatch.kernels_run()))
    if par.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if args.dump_grads and cfg.adapter.enabled:  # the adapters' gradients under PEFT's names
        from longstraw_mcore.adapters.attach import adapter_set
        from longstraw_mcore.adapters.peft_io import dump_grads

        dump_grads(adapter_set(ddp), out / "grads.safetensors", log=rank0_print)
    elif args.dump_grads:
        from longstraw_mcore.checkpoint.convert import dump_hf_tensors

        dump_hf_tensors(get_family(cfg.model.family), ddp.module, cfg.model, out / "grads.safetensors", grads=True,
                        log=rank0_print)
    if args.dump_grads and critic is not None:  # the critic's, under its Hugging Face names (score.* included)
        from longstraw_mcore.adapters.attach import adapter_set
        from longstraw_mcore.checkpoint.convert import dump_hf_tensors

        if ccfg.adapter.enabled:  # its adapters and value head, under PEFT's names
            from longstraw_mcore.adapters.peft_io import dump_grads

            dump_grads(adapter_set(critic), out / "critic_grads.safetensors", log=rank0_print)
        else:
            dump_hf_tensors(get_family(ccfg.model.family), critic.module, ccfg.model,
                            out / "critic_grads.safetensors", grads=True, log=rank0_print)
    if par.rank == 0:
        merged = {}
        for res, *_ in gathered:  # state bytes differ by rank (TP heads, CP shares, pipeline stages): the largest
            for i, r in res.items():
                big = {k: max(r[k], merged[i][k]) for k in ("state_bytes", "ref_state_bytes", "critic_state_bytes")
                       if k in r} if i in merged else {}
                merged[i] = dict(r, **big)
        receipt = {
            "loss": sum(merged[i]["loss"] for i in range(n)) / n,
            "logprobs": [merged[i]["logprobs"] for i in range(n)],
            "skipped_groups": [i for i in range(n) if merged[i]["skipped"]],
            "response_tokens": sum(merged[i]["tokens"] for i in range(n)),
            "replayed_tokens": sum(merged[i]["replayed"] for i in range(n)),  # prefix trees: shared segments once
            "grad_norm": gn, "mode": cfg.replay.mode, "objective": cfg.grpo.objective,
            "trained": trained_description(cfg),
            "layout": par.layout(), "peak_bytes_per_rank": [g[2] for g in gathered],
            "state_bytes_per_group": [merged[i]["state_bytes"] for i in range(n)],
            "ref_state_bytes_per_group": [merged[i]["ref_state_bytes"] for i in range(n)],
            "seconds": {k: max(g[1].get(k, 0.0) for g in gathered) for k in gathered[0][1]},
            "seconds_per_group": [merged[i]["seconds"] for i in range(n)],  # (rank 0's share of each: the
            # largest rank's totals are `seconds`; a group's first run in a process pays its first touches)
            "kernels": _kernels([g[5] for g in gathered]),
            "model": cfg.model.describe(),
            "memory": _memory_receipt(cfg, groups, par.world_size, [g[4] for g in gathered]),
            "software": _versions(),
            **_layer_receipt(cfg.model, merge_reports([g[3] for g in gathered], cfg.model, par.ep)),
            "config": dataclasses.asdict(cfg),
        }
        if critic is not None:  # PPO: per group, per branch, per token
            receipt.update(value_loss=sum(merged[i]["value_loss"] for i in range(n)) / n, critic_grad_norm=critic_gn,
                           **{k: [merged[i][k] for i in range(n)] for k in ("values", "advantages", "returns")},
                           critic_state_bytes_per_group=[merged[i]["critic_state_bytes"] for i in range(n)])
        if scores is not None:
            receipt["reward_model_scores"] = scores
        tmp = out / ".receipt.json.tmp"
        tmp.write_text(json.dumps(receipt, indent=1))
        os.replace(tmp, out / "receipt.json")
        rank0_print(f"[validate] loss {receipt['loss']:.6g}, grad norm {gn:.6g}, wrote {out}/receipt.json"
                    + (" and grads.safetensors" if args.dump_grads else ""))
    dist.barrier()
    return 0


def _kernels(per_rank: list[dict]) -> dict:
    """Every rank's {op: {kernel: calls}} summed."""
    out: dict = {}
    for runs in per_rank:
        for op, per in runs.items():
            for name, calls in per.items():
                out.setdefault(op, {})[name] = out.get(op, {}).get(name, 0) + calls
    return {op: dict(sorted(per.items())) for op, per in sorted(out.items())}


def _slots(n: int, dp: int, dp_rank: int, ep: int) -> list[tuple[int, bool]]:
    """(group, stand-in?) this data-parallel rank replays: groups dp_rank, dp_rank + dp, ...; under expert
    parallelism every rank runs ceil(n / dp) of them, a rank past the last group replaying group
    (slot % n) as a stand-in with its gradient scaled by 0, because the ranks of an EP group exchange
    tokens in every MoE layer and must all run each step (without EP a rank with no group only joins the
    reduction at the end, which every rank reaches)."""
    slots = -(-n // dp) if ep > 1 else 0
    return [(i % n, i >= n) for i in range(dp_rank, max(n, slots * dp), dp)]


def _layer_receipt(m, touched: dict) -> dict:
    """Every decoder layer: its kind, the ranks that ran it, its prompt-state bytes (analytic, whole model, the
    model's dtype, exact mode's chunk boundaries left out) as `state_bytes_per_position`, what each further prompt
    position adds (an MLA latent, an index key, a pooled key's share), and `state_bytes_constant`, what the layer
    keeps whatever the prompt's length (a recurrent state); a pooled layer also keeps the raw keys of an incomplete
    last pool (prompt_state/mla_pool.py). Layers with a DSA indexer add the IndexShare schedule."""
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes

    layers = get_family(m.family).layers
    per_layer = [_state_growth(lambda n, t=t: sum(analytic_state_bytes(layers, m, 1, n, layer_types=[t]).values()))
                 for t in m.layer_types]
    for entry, (per, const) in zip(touched["layers"], per_layer):
        entry["state_bytes_per_position"], entry["state_bytes_constant"] = per, const
    out = dict(touched, state_bytes_per_position=sum(p for p, _ in per_layer),
               state_bytes_constant=sum(c for _, c in per_layer))
    if getattr(m, "indexer_types", None) is not None:  # (over every layer, as transformers keeps it; the indexer
        # runs in the DSA layers of type mla_dsa_full)
        out["index_share_schedule"] = {"indexer_types": list(m.indexer_types),
                                       "full_layers": [i for i, t in enumerate(m.layer_types) if t == "mla_dsa_full"]}
        out["indexer_gradient"] = ("none: the DSA top-k selection is not differentiable, so the indexer weights get "
                                   "no policy gradient (as in the transformers reference)")
    return out


def _state_growth(at) -> tuple:
    """`at(n)`: bytes kept for n prompt positions -> (bytes per position, constant bytes), read between n = L and
    2 L with L a multiple of every pool length up to 128 (pooled keys grow by whole pools)."""
    from fractions import Fraction
    from math import lcm

    L = lcm(*range(1, 129))
    per = Fraction(at(2 * L) - at(L), L)
    const = at(L) - per * L
    return tuple(int(x) if x.denominator == 1 else float(x) for x in (per, const))


def _memory_receipt(cfg, groups, world: int, measured: list[int]) -> dict:
    """The planner's per-rank bytes for the largest group beside each rank's measured peak above the
    process's baseline (validate builds no optimizer: the plan's optimizer term is left out)."""
    from longstraw_mcore.planner.memory import no_optimizer_plan

    P = max(len(g.prompt) for g in groups)
    R = max(len(r) for g in groups for r in g.responses)
    G = max(len(g.responses) for g in groups)
    planned = no_optimizer_plan(get_family(cfg.model.family), cfg, P, R, G, world)
    total = sum(planned.values())
    return {"planned_per_rank_bytes": planned, "planned_total_per_rank": total,
            "measured_peak_above_baseline_per_rank": measured,
            "measured_over_planned_max": max(measured) / total if total else None,
            "what_is_measured": "CUDA: allocator peak minus what was allocated before the model; CPU: peak resident "
                                "set minus the resident set before the model (Linux /proc), which also holds the "
                                "runtime's own tens of MiB: on CPU compare tensor bytes with tools/plan_vs_measured.py",
            "planned_for": {"prompt_len": P, "response_len": R, "group_size": G}}


def _versions() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "megatron-core", "transformers", "triton", "fla-core", "longstraw-mcore"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    import torch

    from longstraw_mcore.ops import triton_interpret

    out["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    out["triton_interpreter"] = triton_interpret.active()
    return out
