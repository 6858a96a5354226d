"""Branch replay for GLM-5.3-Flash (KDA state as Gated DeltaNet's kind, prompt_state/gdn.py; MLA latents with the
pooled indexer's pools and raw tail, prompt_state/mla_pool.py), float64, one rank, the tiny config of
tests/reference/test_glm5_next_parity.py with index_topk 4 in pools of 4 (one pool and the query's incomplete pool:
sparse past the eighth position). Prompt lengths and capture chunks are not multiples of the pool (a chunk and the
prompt's end fall inside pools; branches complete the prompt's last pool).

- exact mode == plain full-sequence GRPO over G copies of [prompt, y_b] (replay/reference.py): loss, per-token
  log-probs and every parameter gradient <= 1e-10, G=1 and G=8 with unequal branch lengths, capture chunks of 5 and
  of the whole prompt;
- detached mode: the same log-probs, and it equals transformers' `Glm5NextForConditionalGeneration` run on
  prompt[:-1] into its cache (KDA conv and recurrent state, MLA latents, the indexer's raw keys) then each branch
  with autograd on a copy of it: log-probs and gradients <= 1e-10;
- the captured state's bytes == the kinds' analytic formula.
"""

from __future__ import annotations

import os
import sys

import torch
from layout_compare import rel

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))


def _worker(rank, world_size):
    from hf_reference import LiftFloat32ToFloat64, hf_grads
    from test_detached_vs_hf_cache import hf_cache_reference
    from test_glm5_next_parity import _configs, _hf_model
    from test_glm_parity import build_glm
    from test_replay_equivalence import grads_and_loss, make_group

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.glm5_next import from_transformers_state, hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.families import get_family
    from longstraw_mcore.families.glm5_next import build_model
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.replay.engine import capture, run_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    hf_mod, hf_cfg, m = _configs(4)
    with LiftFloat32ToFloat64():
        hf = _hf_model(hf_mod, hf_cfg, 5)
    model = build_glm(m, build=build_model)[0]
    load_full(model, hf_to_mcore(from_transformers_state(hf.state_dict()), m))
    gcfg = GRPOConfig(beta=0.05)
    out = {"exact": [], "detached": [], "hf": [], "bytes": []}
    for P, lengths, seed in [(23, [6], 1), (19, [3, 1, 7, 2, 6, 1, 4, 8], 2)]:
        group = make_group(m, P, lengths, seed)
        ref = grads_and_loss(model, group, gcfg,
                             lambda fn: full_sequence_branches(model, group.prompt, group.responses, fn))
        for chunk in (5, P - 1):
            got = {}
            for mode in ("exact", "detached"):
                cfg = ReplayConfig(mode=mode, chunk_len=chunk)
                got[mode] = grads_and_loss(model, group, gcfg, lambda fn: [r.logprobs for r in run_group(
                    model, group.prompt, group.responses, fn, cfg)[0]])
            (l, lp, g), (_, lpd, _) = got["exact"], got["detached"]
            out["exact"].append(dict(P=P, G=len(lengths), chunk=chunk, loss=abs(l - ref[0]) / abs(ref[0]),
                                     logp=max(rel(a, b) for a, b in zip(lp, ref[1])),
                                     grad=max(rel(g[k], ref[2][k]) for k in ref[2]), n=len(ref[2])))
            out["detached"].append(dict(P=P, chunk=chunk, logp=max(rel(a, b) for a, b in zip(lpd, ref[1]))))
        # detached against transformers' own cache
        fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
        hf.zero_grad(set_to_none=True)
        ref_lp = hf_cache_reference(hf, group, fn, LiftFloat32ToFloat64)
        ref_g = hf_to_mcore(from_transformers_state(hf_grads(hf)), m)
        model.zero_grad(set_to_none=True)
        res, _ = run_group(model, group.prompt, group.responses, fn, ReplayConfig(mode="detached", chunk_len=5))
        g = gather_full(model, grads=True)
        keys = [k for k in ref_g if ref_g[k].abs().max() > 0 and ".indexer." not in k]
        out["hf"].append(dict(P=P, G=len(lengths), logp=max(rel(r.logprobs, lp) for r, lp in zip(res, ref_lp)),
                              grad=max(rel(g[k], ref_g[k]) for k in keys), n=len(keys)))
        st = capture(model, torch.tensor([group.prompt[:-1]]), ReplayConfig(chunk_len=5))
        out["bytes"].append((st.nbytes_by_type(), analytic_state_bytes(get_family(m.family).layers, m, 1, P - 1)))
    return out


def test_glm5_next_replay_exact_detached_and_hf_cache():
    out = run_ranks(_worker, 1, timeout_s=600)[0]
    for r in out["exact"]:
        print(f"GLM-5.3 exact P={r['P']} G={r['G']} chunk={r['chunk']}: loss {r['loss']:.1e}, logp {r['logp']:.1e}, "
              f"worst of {r['n']} gradients {r['grad']:.1e}")
        assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10, r
    for r in out["detached"]:
        print(f"GLM-5.3 detached P={r['P']} chunk={r['chunk']}: logp {r['logp']:.1e}")
        assert r["logp"] <= 1e-10, r
    for r in out["hf"]:
        print(f"GLM-5.3 detached vs HF cache P={r['P']} G={r['G']}: logp {r['logp']:.1e}, worst of {r['n']} "
              f"gradients {r['grad']:.1e}")
        assert r["logp"] <= 1e-10 and r["grad"] <= 1e-10 and r["n"] > 60, r
    for measured, analytic in out["bytes"]:
        print(f"GLM-5.3 state bytes {measured} (analytic {analytic})")
        assert measured == analytic and {"mla_latent", "dsa_pooled_keys", "gdn_state"} <= set(measured), measured
