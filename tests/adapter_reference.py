"""`peft` on `transformers` as the adapter reference (an implementation nobody here wrote): a random
non-zero LoRA on every default target, full-sequence autograd (exact mode's objective) and the cache
path (detached mode's; with the adapter disabled while the prompt cache is built for
adapter.prompt=frozen)."""

from __future__ import annotations

import contextlib

import torch

PREFIX = "base_model.model."


def random_peft(hf, targets: list[str] | str, r: int, alpha: float, seed: int):
    """`peft` LoRA on `targets` with A and B both random (B scaled to 0.1 of PEFT's non-zero init)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                          init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64) * (0.1 if "lora_B" in n else 1.0)
    model.eval()
    return model


def lora_grads(peft_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (dA, dB)} under the module's HF name."""
    out: dict[str, list] = {}
    for n, p in peft_model.named_parameters():
        if "lora_" not in n:
            continue
        mod, which = n[len(PREFIX):].split(".lora_")
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.setdefault(mod, [None, None])[which.startswith("B")] = g.detach().clone()
    return {k: tuple(v) for k, v in out.items()}


def full_sequence(peft_model, group, loss_fn, lift):
    """Exact mode's reference: every branch as its own full sequence with autograd."""
    P, logps = len(group.prompt), []
    for b, resp in enumerate(group.responses):
        with lift():
            logits = peft_model(input_ids=torch.tensor([group.prompt + resp[:-1]])).logits[0, P - 1:]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        loss_fn(b, logp)[0].backward()
        logps.append(logp.detach())
    return logps


def cache_path(peft_model, group, loss_fn, lift, frozen_prompt: bool = False, also_off=contextlib.nullcontext):
    """Detached mode's reference: the prompt cache under no_grad (adapter off with `frozen_prompt`, and
    `also_off()` for adapters outside peft), each branch with autograd on a copy of it."""
    from test_detached_vs_hf_cache import hf_cache_reference

    @contextlib.contextmanager
    def off():
        with peft_model.disable_adapter(), also_off():
            yield

    return hf_cache_reference(peft_model, group, loss_fn, lift, off if frozen_prompt else contextlib.nullcontext)


def worst(ours: dict, ref: dict) -> tuple[float, str]:
    """Largest relative difference over every adapter factor (relative to the factor's largest value)."""
    assert set(ours) == set(ref), sorted(set(ours) ^ set(ref))[:4]
    w, at = 0.0, ""
    for k in ref:
        for i, (a, b) in enumerate(zip(ours[k], ref[k])):
            d = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
            if d > w:
                w, at = d, f"{k}.lora_{'AB'[i]}"
    return w, at


def compare_layouts(m, groups, gcfg, reference, layouts, chunk_len: int, rank: int, world_size: int) -> list[dict]:
    """Every layout against the reference: rank 0's `reference()` gives (base tensors, PEFT directory,
    {(mode, frozen prompt): per group (log-probs, adapter gradients)}); each layout builds the model, loads
    the base, reads the adapter, and runs every case through Megatron DDP over the adapters (its average
    over data x context parallel ranks completes the gradients, as in training). Returns the worst
    differences per (layout, case) on rank 0."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.adapters.peft_io import gather_canonical, read_peft
    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.config import AdapterConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import run_group
    from longstraw_mcore.train.trainer import wrap_ddp

    fam = get_family(m.family)
    base, d, ref = reference() if rank == 0 else (None, None, None)
    box = [base, d]
    dist.broadcast_object_list(box, src=0)
    base, d = box
    # exact mode with prompt=frozen runs as detached (replay/engine.py): checked at one rank, the same
    # plan as detached-frozen under the other layouts
    cases = (("exact", False), ("detached", False), ("detached", True)) + ((("exact", True),) if world_size == 1
                                                                           else ())
    out = []
    for layout in layouts:
        run = RunConfig(model=m, parallel=ParallelConfig(**layout), device="cpu")
        par = setup_parallel(run)
        model = fam.build_model(m, par, "cpu")
        load_full(model, base)
        sites = fam.checkpoint.adapter_sites(m)
        cfg, canon = read_peft(d, sites, AdapterConfig())
        aset = attach(model, sites, cfg, par, seed=0, canonical=canon, padded_vocab=model.padded_vocab_size)
        ddp = wrap_ddp(model, run, par)
        for mode, frozen in cases:
            aset.cfg = dataclasses.replace(cfg, prompt="frozen" if frozen else "adapted")
            worst_lp, worst_g, base_grads = 0.0, (0.0, ""), 0
            for gi, group in enumerate(groups):
                fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
                ddp.zero_grad_buffer()
                res, _ = run_group(ddp, group.prompt, group.responses, fn, ReplayConfig(mode=mode, chunk_len=chunk_len))
                finalize_model_grads([ddp], pg_collection=par.pgs)
                base_grads += sum(p.grad is not None or hasattr(p, "main_grad")
                                  for n, p in model.named_parameters() if not n.startswith("adapters."))
                g = gather_canonical(aset, par, grads=True)
                every = [None] * world_size if rank == 0 else None
                dist.gather_object([r.logprobs for r in res], every, dst=0)  # the last stage holds them
                if rank == 0:
                    lp_ref, g_ref = ref[("exact", False) if (mode, frozen) == ("exact", False) else ("detached", frozen)][gi]
                    lps = next(x for x in every if x)
                    worst_lp = max(worst_lp, max(float((a - b).abs().max()) for a, b in zip(lps, lp_ref)))
                    worst_g = max(worst_g, worst(g, g_ref))
            out.append(dict(layout=layout, mode=mode, frozen=frozen, logp=worst_lp, grad=worst_g[0], at=worst_g[1],
                            base_grads=base_grads, n_adapters=len(aset.lora)))
    return out


def check_layouts(out: list[dict], prefix: str = "") -> None:
    """Print and assert compare_layouts' rows: log-probs and adapter gradients <= 1e-10, no base gradient."""
    for r in out:
        print(f"{prefix}{r['layout'] or 'one rank'} {r['mode']}{' prompt=frozen' if r['frozen'] else ''}: logp "
              f"{r['logp']:.1e}, worst adapter grad {r['grad']:.1e} ({r['at']}), {r['n_adapters']} adapters on rank 0")
    for r in out:
        assert r["logp"] <= 1e-10 and r["grad"] <= 1e-10, r
        assert r["base_grads"] == 0, r
