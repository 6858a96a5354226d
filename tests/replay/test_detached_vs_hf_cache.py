"""detached mode == the Hugging Face cache reference, an implementation nobody here wrote.

The reference: `transformers` runs prompt[:-1] under no_grad and returns its cache; each branch then
runs with autograd on a copy of that cache (so the prompt state is a constant: exactly the
truncated gradient detached mode defines), and the same GRPO loss terms are back-propagated.
Harness work-around (no change to the reference's math): the reference's linear-attention cache
writes the new conv/recurrent state into the cached tensors in place, which autograd rejects once the
old value is saved in the graph; during branch forwards the two cache-update methods assign the new
tensor instead of copying into the old one (`assigning_linear_cache`, shared with the side-by-side
bench: longstraw_mcore/bench/vs_transformers.py). The reference runs under `LiftFloat32ToFloat64` (its
float32 upcasts made float64, see tests/hf_reference.py), so the tolerance is the float64 one.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from longstraw_mcore.launch_local import run_ranks


def hf_cache_reference(hf, group, loss_fn, lift, prompt_off=contextlib.nullcontext):
    """Per-branch log-probs with autograd against a no-grad prompt cache; backward of each term.
    `prompt_off()`: a context the prompt cache is built inside (adapters switched off, for instance)."""
    from transformers import DynamicCache

    from longstraw_mcore.bench.vs_transformers import assigning_linear_cache

    P = len(group.prompt)
    with lift(), torch.no_grad(), prompt_off():
        cache = DynamicCache(config=hf.config)
        hf(input_ids=torch.tensor([group.prompt[:-1]]), past_key_values=cache, use_cache=True)
    logps = []
    for b, resp in enumerate(group.responses):
        c = copy.deepcopy(cache)
        with lift(), assigning_linear_cache():
            logits = hf(input_ids=torch.tensor([[group.prompt[-1]] + resp[:-1]]), past_key_values=c,
                        use_cache=True).logits[0]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        loss, _ = loss_fn(b, logp)
        loss.backward()
        logps.append(logp.detach())
    assert P > 1
    return logps


def _worker(rank, world_size):
    from hf_reference import LiftFloat32ToFloat64, build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import make_group, rel

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.loss.grpo import GRPOConfig, advantages, group_loss_fn
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.engine import ReplayConfig, run_group

    m = tiny_model_config()
    with LiftFloat32ToFloat64():
        hf = build_hf_model(m, seed=7)
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m, par, "cpu")
    load_full(model, hf_to_mcore(hf_state(hf), m))
    gcfg = GRPOConfig(beta=0.05)
    out = []
    for P, lengths, seed in [(23, [5, 1, 9], 11), (9, [2, 6], 12)]:
        group = make_group(m, P, lengths, seed)
        fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
        hf.zero_grad(set_to_none=True)
        ref_lp = hf_cache_reference(hf, group, fn, LiftFloat32ToFloat64)
        ref_g = hf_to_mcore({n: (p.grad if p.grad is not None else torch.zeros_like(p))
                             for n, p in hf.named_parameters()}, m)
        model.zero_grad(set_to_none=True)
        res, _ = run_group(model, group.prompt, group.responses, fn, ReplayConfig(mode="detached", chunk_len=4))
        g = gather_full(model, grads=True)
        worst = max(g, key=lambda k: rel(g[k], ref_g[k]) if ref_g[k].abs().max() > 0 else 0.0)
        zero_in_ref = sorted(k for k in ref_g if ref_g[k].abs().max() == 0)
        out.append(dict(P=P, G=len(lengths), logp=max(rel(r.logprobs, lp) for r, lp in zip(res, ref_lp)),
                        grad=rel(g[worst], ref_g[worst]), worst=worst, zero_in_ref=zero_in_ref,
                        ours_zero=all(float(g[k].abs().max()) == 0 for k in zero_in_ref)))
    return out


def test_detached_equals_hf_cache_reference():
    out = run_ranks(_worker, 1, timeout_s=600)[0]
    for r in out:
        print(f"detached vs HF cache reference: P={r['P']} G={r['G']}: logp {r['logp']:.1e}, worst grad "
              f"{r['grad']:.1e} ({r['worst']}); zero in both: {len(r['zero_in_ref'])} tensors")
    for r in out:
        assert r["logp"] <= 1e-6 and r["grad"] <= 1e-6, r
        assert r["ours_zero"], r
