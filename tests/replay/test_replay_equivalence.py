"""Branch replay computes the gradient it names.

exact    == plain full-sequence GRPO over G copies of [prompt, y_b] on the same Megatron model: the
           exact mode adds the state-gradient path (sum_b dL_b/dS) dS/dtheta through the reverse chunk
           sweep, so it must equal ordinary autograd over the whole sequence, to float64 rounding.
detached == Hugging Face `transformers` run on prompt[:-1] under no_grad returning its cache, then on
           each branch with autograd using a copy of that cache (the prompt state is a constant there
           by construction): per-token log-probs and gradients, mapped through the conversion table.
Rollout loss masks: exact replay of a masked group equals its full sequences, with every log-prob reported.
Invariances: branch order, capture chunk size, one branch at a time (replay.batch_tokens=0) vs all
branches batched and vs a token budget that cuts the group into 2-3 micro-steps of different sizes
(branches of different lengths, right-padded within each), attention probabilities recomputed vs
stored (`replay.attn_probs_budget_mib`).
The objective exercises every term: off-policy old log-probs (so clipping is active), k3 KL to
reference log-probs, token-mean aggregation; G=1 has zero advantage and keeps only the KL term.
Not covered here: TP (tests/replay/test_replay_tp.py), pipeline parallelism (replay runs at PP=1).
"""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def make_group(m, P, lengths, seed, ref_model_logps=None):
    from longstraw_mcore.data.rollouts import RolloutGroup

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, m.vocab_size, (P,), generator=g).tolist()
    resp = [torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for n in lengths]
    rewards = torch.rand(len(lengths), generator=g, dtype=torch.float64).tolist()
    old = [(-3.0 + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).tolist() for n in lengths]
    ref = [(-3.0 + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).tolist() for n in lengths]
    return RolloutGroup(prompt=prompt, responses=resp, rewards=rewards, old_logprobs=old, ref_logprobs=ref)


def grads_and_loss(model, group, gcfg, runner):
    from longstraw_mcore.checkpoint.full_state import gather_full
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn

    fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
    losses = []

    def tracking(b, lp):
        loss, stats = fn(b, lp)
        losses.append(float(loss.detach()))
        return loss, stats

    model.zero_grad(set_to_none=True)
    logps = runner(tracking)
    return sum(losses), logps, gather_full(model, grads=True)


def _worker(rank, world_size):
    from hf_reference import build_hf_model, hf_state, tiny_model_config

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import ParallelConfig, RunConfig
    from longstraw_mcore.loss.grpo import GRPOConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.families import get_family
    from longstraw_mcore.replay.engine import ReplayConfig, capture, group_replay_steps, run_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    m = tiny_model_config()
    hf = build_hf_model(m, seed=3)
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m, par, "cpu")
    load_full(model, hf_to_mcore(hf_state(hf), m))
    gcfg = GRPOConfig(beta=0.05)
    out = {"exact": [], "invariance": [], "bytes": []}
    from longstraw_mcore.replay import steps

    recomputes, recompute = [], steps.recompute_chunk
    steps.recompute_chunk = lambda *a, **k: (recomputes.append(1), recompute(*a, **k))[1]

    # "split": a budget that cuts each larger group into micro-steps of different sizes: [5, 1, 9] at 10
    # tokens -> (5 1) (9); [3, 1, 7, 2, 6, 1, 4, 8] at 24 -> (3 1 7) (2 6 1 4) (8); [4, 2, 1] -> (4 2) (1)
    split = {3: 10, 8: 24}
    for P, lengths, seed in [(23, [1], 1), (23, [5, 1, 9], 2), (17, [3, 1, 7, 2, 6, 1, 4, 8], 3), (1, [4, 2, 1], 4)]:
        group = make_group(m, P, lengths, seed)
        ref_loss, ref_lp, ref_g = grads_and_loss(model, group, gcfg, lambda fn: full_sequence_branches(
            model, group.prompt, group.responses, fn))
        for chunk in sorted({5, max(P - 1, 1)}):
            for mode in ("exact", "detached"):
                cfg = ReplayConfig(mode=mode, chunk_len=chunk, batch_tokens=0)  # one branch at a time
                loss, lp, g = grads_and_loss(model, group, gcfg, lambda fn: [
                    r.logprobs for r in run_group(model, group.prompt, group.responses, fn, cfg)[0]])
                if mode == "exact":
                    worst = max(g, key=lambda k: rel(g[k], ref_g[k]))
                    out["exact"].append(dict(P=P, G=len(lengths), chunk=chunk, loss=abs(loss - ref_loss) / abs(ref_loss),
                                             logp=max(rel(a, b) for a, b in zip(lp, ref_lp)), grad=rel(g[worst], ref_g[worst]),
                                             worst=worst))
                else:
                    num = sum(float((g[k] * ref_g[k]).sum()) for k in g)
                    den = (sum(float((g[k] ** 2).sum()) for k in g) * sum(float((ref_g[k] ** 2).sum()) for k in g)) ** 0.5
                    out.setdefault("cosine", []).append((P, len(lengths), num / den))
                # invariances on the larger groups: reversed branch order, batched branches (all in one
                # micro-step, or split by the budget), attention probabilities stored in forward instead of
                # recomputed in backward (one at a time, batched)
                # exact mode: the capture chunks' graphs kept for the sweep instead of recomputed, all of them
                # or the last ones within a budget (replay.keep_prompt_graph_mib; the recomputes counted)
                kept_variants = ("kept", "kept-partial", "batched+kept") if mode == "exact" and P > 1 else ()
                if len(lengths) >= 3 or kept_variants:
                    for variant in (("reversed", "batched", "split", "stored", "batched+stored")
                                    if len(lengths) >= 3 else ()) + kept_variants:
                        keep = {"kept": 64.0, "batched+kept": 64.0, "kept-partial": 0.3}.get(variant, 0.0)
                        budget = 1 << 20 if "batched" in variant else split[len(lengths)] if "split" in variant else 0
                        vcfg = ReplayConfig(mode=mode, chunk_len=chunk, batch_tokens=budget,
                                            attn_probs_budget_mib=64.0 if "stored" in variant else 0.0,
                                            keep_prompt_graph_mib=keep)
                        order = list(reversed(range(len(lengths)))) if variant == "reversed" else None
                        recomputes.clear()
                        l2, lp2, g2 = grads_and_loss(model, group, gcfg, lambda fn: [
                            r.logprobs for r in run_group(model, group.prompt, group.responses, fn, vcfg,
                                                          order=order)[0]])
                        steps = [len(st.branches) for st in group_replay_steps(model, group.responses, vcfg, order)]
                        out["invariance"].append(dict(P=P, mode=mode, chunk=chunk, variant=variant,
                                                      grad=max(rel(g2[k], g[k]) for k in g),
                                                      logp=max(rel(a, b) for a, b in zip(lp2, lp)),
                                                      loss=abs(l2 - loss) / abs(loss), recomputed=len(recomputes),
                                                      chunks=-(-(P - 1) // chunk), steps=steps))
        # chunk-size invariance within each mode
        for mode in ("exact", "detached"):
            gs = [grads_and_loss(model, group, gcfg, lambda fn: [r.logprobs for r in run_group(
                model, group.prompt, group.responses, fn, ReplayConfig(mode=mode, chunk_len=c, batch_tokens=0))[0]])[2]
                for c in (3, 64)]
            out["invariance"].append(dict(P=P, mode=mode, chunk="3 vs 64", variant="chunk",
                                          grad=max(rel(gs[0][k], gs[1][k]) for k in gs[1]), logp=0.0, loss=0.0))
        # measured state bytes == analytic formula (exact mode keeps GDN state at chunk boundaries)
        for mode, chunk in (("detached", 5), ("exact", 5), ("exact", 64)):
            st = capture(model, torch.tensor([group.prompt[:-1]]), ReplayConfig(mode=mode, chunk_len=chunk))
            n_chunks = len(st.chunk_bounds) if mode == "exact" else 0
            out["bytes"].append((P, mode, chunk, st.nbytes_by_type(), analytic_state_bytes(get_family(m.family).layers, m, 1, P - 1, n_chunks)))
    # rollout loss masks (the masked objective itself: tests/unit/test_loss_masks.py): exact replay equals
    # full sequences; every token's log-prob is still computed and reported, equal to the unmasked run's
    group = make_group(m, 23, [5, 1, 9], 2)
    group.loss_masks = [[1, 0, 0, 1, 1], [0], [1, 1, 1, 0, 0, 0, 1, 0, 1]]
    ref_loss, ref_lp, ref_g = grads_and_loss(model, group, gcfg, lambda fn: full_sequence_branches(
        model, group.prompt, group.responses, fn))
    runs = {}
    for name, masks in (("masked", group.loss_masks), ("plain", None)):
        group.loss_masks = masks
        runs[name] = grads_and_loss(model, group, gcfg, lambda fn: [r.logprobs for r in run_group(
            model, group.prompt, group.responses, fn, ReplayConfig(mode="exact", chunk_len=5))[0]])
    (loss, lp, g), (_, lp0, g0) = runs["masked"], runs["plain"]
    out["masked"] = dict(loss=abs(loss - ref_loss) / abs(ref_loss), logp=max(rel(a, b) for a, b in zip(lp, ref_lp)),
                         grad=max(rel(g[k], ref_g[k]) for k in g), lengths=[len(x) for x in lp],
                         logp_vs_plain=max(rel(a, b) for a, b in zip(lp, lp0)), grad_vs_plain=max(rel(g[k], g0[k]) for k in g))
    return out


def test_exact_equals_full_sequence_and_invariances():
    out = run_ranks(_worker, 1, timeout_s=900)[0]
    for r in out["exact"]:
        print(f"exact vs full-sequence GRPO: P={r['P']} G={r['G']} chunk={r['chunk']}: loss {r['loss']:.1e}, "
              f"logp {r['logp']:.1e}, worst grad {r['grad']:.1e} ({r['worst']})")
    for r in out["invariance"]:
        print(f"invariance {r['variant']:>14} {r['mode']:>8} P={r['P']} chunk={r['chunk']}: grad {r['grad']:.1e}, "
              f"logp {r['logp']:.1e}, loss {r['loss']:.1e}"
              + (f", branches per micro-step {r['steps']}" if "steps" in r else ""))
    for P, G, cos in out["cosine"]:
        print(f"cosine(detached, exact) P={P} G={G}: {cos:.6f}")
    assert len(out["exact"]) >= 8
    for r in out["exact"]:
        assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10, r
    for r in out["invariance"]:
        assert r["grad"] <= 1e-10 and r["logp"] <= 1e-10 and r["loss"] <= 1e-10, r
    # the variants ran the micro-steps they name: one per branch, all in one, or 2-3 of different sizes
    for r in out["invariance"]:
        if "steps" in r:
            n = sum(r["steps"])
            want = ([n] if "batched" in r["variant"] else {3: [2, 1], 8: [3, 4, 1]}[n] if "split" in r["variant"]
                    else [1] * n)
            assert r["steps"] == want, r
    assert {r["mode"] for r in out["invariance"] if r["variant"] == "split"} == {"exact", "detached"}
    kept = [r for r in out["invariance"] if "kept" in r["variant"]]
    for r in kept:
        print(f"kept prompt graph {r['variant']:>13} P={r['P']} chunk={r['chunk']}: {r['recomputed']} of {r['chunks']} "
              f"chunks recomputed")
    assert kept and all(r["recomputed"] == 0 for r in kept if r["variant"] != "kept-partial")
    assert any(0 < r["recomputed"] < r["chunks"] for r in kept if r["variant"] == "kept-partial")
    for P, mode, chunk, measured, analytic in out["bytes"]:
        print(f"state bytes P={P} {mode} chunk={chunk}: measured {measured} analytic {analytic}")
        assert measured == analytic
    assert any(cos < 0.9999 for _, G, cos in out["cosine"] if G > 1)  # the two modes really differ
    mk = out["masked"]
    print(f"loss masks, exact vs full sequences: {mk}")
    assert mk["loss"] <= 1e-10 and mk["logp"] <= 1e-10 and mk["grad"] <= 1e-10, mk
    assert mk["lengths"] == [5, 1, 9] and mk["logp_vs_plain"] == 0.0 and mk["grad_vs_plain"] > 1e-3, mk


def _dpo_worker(rank, world_size):
    import torch.nn.functional as F
    from hf_reference import build_hf_model, hf_state, tiny_model_config

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.loss.logprobs import token_logprobs
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group

    m = tiny_model_config()
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    model = build_model(m, par, "cpu")
    load_full(model, hf_to_mcore(hf_state(build_hf_model(m, seed=8)), m))
    group = make_group(m, 21, [6, 3], seed=31)
    group.rewards = [0.2, 0.9]           # branch 1 is chosen
    group.old_logprobs = None
    beta = 0.5
    out = {}
    # plain autograd over the full sequences, the DPO loss as written
    model.zero_grad(set_to_none=True)
    sums = []
    for b, resp in enumerate(group.responses):
        hidden = model(torch.tensor([group.prompt + resp[:-1]]), hidden_only=True)
        sums.append(token_logprobs(model.output_layer, hidden[len(group.prompt) - 1:], torch.tensor([resp]))[0].sum())
    ref = [sum(x) for x in group.ref_logprobs]
    z = beta * ((sums[1] - ref[1]) - (sums[0] - ref[0]))
    ref_loss = -F.logsigmoid(z)
    ref_loss.backward()
    ref_g = gather_full(model, grads=True)
    for mode in ("exact", "detached"):
        model.zero_grad(set_to_none=True)
        st = process_group(model, group, ReplayConfig(mode=mode, chunk_len=5), GRPOConfig(objective="dpo", beta=beta))
        g = gather_full(model, grads=True)
        out[mode] = dict(loss=abs(st.loss - float(ref_loss)) / float(ref_loss), grad=max(rel(g[k], ref_g[k]) for k in g))
    return out


def test_dpo_exact_equals_full_sequence_dpo():
    out = run_ranks(_dpo_worker, 1, timeout_s=600)[0]
    print(f"DPO exact vs full-sequence: loss {out['exact']['loss']:.1e}, worst grad {out['exact']['grad']:.1e}; "
          f"detached worst grad {out['detached']['grad']:.1e} (differs: truncated)")
    assert out["exact"]["loss"] <= 1e-12 and out["exact"]["grad"] <= 1e-10
    assert out["detached"]["loss"] <= 1e-12 and out["detached"]["grad"] > 1e-3


def _ref_model_worker(rank, world_size):
    from hf_reference import build_hf_model, hf_state, tiny_model_config

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    m = tiny_model_config()
    par = setup_parallel(RunConfig(model=m, parallel=ParallelConfig(), device="cpu"))
    policy, ref = build_model(m, par, "cpu"), build_model(m, par, "cpu")
    load_full(policy, hf_to_mcore(hf_state(build_hf_model(m, seed=12)), m))
    load_full(ref, hf_to_mcore(hf_state(build_hf_model(m, seed=13)), m))
    group = make_group(m, 15, [4, 2, 5], seed=41)
    group.ref_logprobs = None
    gcfg, rcfg = GRPOConfig(beta=0.3), ReplayConfig(mode="exact", chunk_len=4)
    policy.zero_grad(set_to_none=True)
    st = process_group(policy, group, rcfg, gcfg, ref_model=ref)
    g_ref_model = gather_full(policy, grads=True)
    # the same group with ref_logprobs scored independently (full sequence, plain forward)
    group.ref_logprobs = [lp.tolist() for lp in full_sequence_branches(ref, group.prompt, group.responses, None)]
    policy.zero_grad(set_to_none=True)
    st2 = process_group(policy, group, rcfg, gcfg)
    g_file = gather_full(policy, grads=True)
    return dict(grad=max(rel(g_ref_model[k], g_file[k]) for k in g_file), loss=abs(st.loss - st2.loss),
                kl=st.kl_sum, ref_state_bytes=st.ref_state_bytes, ref_state_bytes_file=st2.ref_state_bytes)


def test_reference_model_scoring_equals_given_ref_logprobs():
    """beta > 0 without ref_logprobs: the reference policy is scored by a no-grad replay from its own
    captured state; the result equals supplying its full-sequence log-probs in the rollouts."""
    r = run_ranks(_ref_model_worker, 1, timeout_s=600)[0]
    print(f"reference-model scoring vs given ref_logprobs: worst grad {r['grad']:.1e}, KL sum {r['kl']:.4f}, "
          f"reference state {r['ref_state_bytes']} B")
    assert r["grad"] <= 1e-10 and r["loss"] <= 1e-12
    assert r["kl"] > 1e-3 and r["ref_state_bytes"] > 0 and r["ref_state_bytes_file"] == 0
