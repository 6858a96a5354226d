"""Branch replay for the GLM-5.x family (MLA latent + indexer-key prompt state, prompt_state/mla.py),
float64, one rank, the tiny config of tests/reference/test_glm_parity.py (dense + MoE layers, IndexShare
schedule [full, full, shared, full], 8 indexer heads, index_topk 4: the selection is sparse for every
query past its fourth position, in the prompt and in the branches).

- exact mode == plain full-sequence GRPO over G copies of [prompt, y_b] (replay/reference.py): loss,
  per-token log-probs and every parameter gradient <= 1e-10, for G=1 and G=8 with unequal branch
  lengths (1 to 8), capture chunks of 5 and of the whole prompt;
- detached mode: the same log-probs (the forward is the same) and chunk-size invariance; its gradient
  differs from exact (the truncation is visible: cosine printed); and (second test) it equals the
  Hugging Face cache reference, an implementation nobody here wrote: log-probs and gradients <= 1e-10;
- the captured state's bytes == the kinds' analytic formula (latent + RoPE key per position on every
  layer, the indexer key on the 3 full layers).
"""

from __future__ import annotations

import os
import sys

import torch
from layout_compare import rel

from longstraw_mcore.launch_local import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))



def _worker(rank, world_size):
    from test_glm_parity import _configs, _hf_model, build_glm
    from test_replay_equivalence import grads_and_loss, make_group

    from longstraw_mcore.checkpoint.full_state import load_full
    from longstraw_mcore.checkpoint.glm_dsa import from_transformers_state, hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.prompt_state.containers import analytic_state_bytes
    from longstraw_mcore.families import get_family
    from longstraw_mcore.replay.engine import capture, run_group
    from longstraw_mcore.replay.reference import full_sequence_branches

    hf_cfg, m = _configs(4)
    model = build_glm(m)[0]
    load_full(model, hf_to_mcore(from_transformers_state(_hf_model(hf_cfg, 5).state_dict()), m))
    gcfg = GRPOConfig(beta=0.05)
    out = {"exact": [], "detached": [], "bytes": []}
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
            (l, lp, g), (_, lpd, gd) = got["exact"], got["detached"]
            out["exact"].append(dict(P=P, G=len(lengths), chunk=chunk, loss=abs(l - ref[0]) / abs(ref[0]),
                                     logp=max(rel(a, b) for a, b in zip(lp, ref[1])),
                                     grad=max(rel(g[k], ref[2][k]) for k in ref[2]), n=len(ref[2])))
            num = sum(float((gd[k] * g[k]).sum()) for k in g)
            den = (sum(float((gd[k] ** 2).sum()) for k in gd) * sum(float((g[k] ** 2).sum()) for k in g)) ** 0.5
            out["detached"].append(dict(P=P, chunk=chunk, logp=max(rel(a, b) for a, b in zip(lpd, ref[1])),
                                        cosine=num / den, grads=gd))
        st = capture(model, torch.tensor([group.prompt[:-1]]), ReplayConfig(chunk_len=5))
        out["bytes"].append((st.nbytes_by_type(), analytic_state_bytes(get_family(m.family).layers, m, 1, P - 1)))
    # chunk-size invariance of the detached gradient, then drop the tensors
    pairs = [(out["detached"][i]["grads"], out["detached"][i + 1]["grads"]) for i in (0, 2)]
    out["detached_chunk"] = max(rel(a[k], b[k]) for a, b in pairs for k in a)
    for d in out["detached"]:
        d.pop("grads")
    return out


def test_glm_replay_exact_equals_full_sequence():
    out = run_ranks(_worker, 1, timeout_s=600)[0]
    for r in out["exact"]:
        print(f"GLM exact P={r['P']} G={r['G']} chunk={r['chunk']}: loss {r['loss']:.1e}, logp {r['logp']:.1e}, "
              f"worst of {r['n']} gradients {r['grad']:.1e}")
        assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10, r
    for r in out["detached"]:
        print(f"GLM detached P={r['P']} chunk={r['chunk']}: logp {r['logp']:.1e}, gradient cosine to exact "
              f"{r['cosine']:.4f}")
        assert r["logp"] <= 1e-10 and r["cosine"] < 0.9999, r
    print(f"GLM detached gradient, chunk 5 vs whole prompt: {out['detached_chunk']:.1e}")
    assert out["detached_chunk"] <= 1e-10
    for measured, analytic in out["bytes"]:
        print(f"GLM state bytes {measured} (analytic {analytic})")
        assert measured == analytic and set(measured) == {"mla_latent", "dsa_index_keys"}


def _detached_worker(rank, world_size):
    from hf_reference import LiftFloat32ToFloat64, hf_grads
    from test_detached_vs_hf_cache import hf_cache_reference
    from test_glm_parity import _configs, _hf_model, build_glm
    from test_replay_equivalence import make_group

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.checkpoint.glm_dsa import from_transformers_state, hf_to_mcore
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.loss.grpo import advantages, group_loss_fn
    from longstraw_mcore.replay.engine import run_group

    hf_cfg, m = _configs(4)
    with LiftFloat32ToFloat64():
        hf = _hf_model(hf_cfg, 5)
    model = build_glm(m)[0]
    load_full(model, hf_to_mcore(from_transformers_state(hf.state_dict()), m))
    gcfg = GRPOConfig(beta=0.05)
    out = []
    for P, lengths, seed in [(23, [5, 1, 9], 11), (19, [3, 1, 7, 2, 6, 1, 4, 8], 12)]:
        group = make_group(m, P, lengths, seed)
        fn = group_loss_fn(group, gcfg, advantages(group.rewards, gcfg))
        hf.zero_grad(set_to_none=True)
        ref_lp = hf_cache_reference(hf, group, fn, LiftFloat32ToFloat64)
        ref_g = hf_to_mcore(from_transformers_state(hf_grads(hf)), m)
        model.zero_grad(set_to_none=True)
        res, _ = run_group(model, group.prompt, group.responses, fn, ReplayConfig(mode="detached", chunk_len=4))
        g = gather_full(model, grads=True)
        keys = [k for k in ref_g if ref_g[k].abs().max() > 0 and ".indexer." not in k]
        out.append(dict(P=P, G=len(lengths), logp=max(rel(r.logprobs, lp) for r, lp in zip(res, ref_lp)),
                        grad=max(rel(g[k], ref_g[k]) for k in keys), n=len(keys)))
    return out


def test_glm_detached_equals_hf_cache_reference():
    """detached == transformers' GlmMoeDsaForCausalLM run on prompt[:-1] under no_grad into its cache
    (latents and indexer keys), then each branch with autograd on a copy of that cache (lifted to
    float64): log-probs and every gradient the reference gives <= 1e-10."""
    for r in run_ranks(_detached_worker, 1, timeout_s=600)[0]:
        print(f"GLM detached vs HF cache: P={r['P']} G={r['G']}: logp {r['logp']:.1e}, worst of {r['n']} "
              f"gradients {r['grad']:.1e}")
        assert r["logp"] <= 1e-10 and r["grad"] <= 1e-10, r
