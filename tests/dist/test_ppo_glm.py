"""PPO with a GLM-5.x critic (MLA + DSA + MoE; the token-classification layout under GLM's names:
`model.*` + `score.weight`, `score.bias`), float64, exact mode: at one rank against transformers'
GlmMoeDsaForCausalLM and GlmMoeDsaModel + a score Linear run as full sequences (tests/ppo_reference.py),
<= 1e-10; at EP=2 (x DP=2, experts split, the MoE all-to-alls in lockstep for the critic too) equal to
one rank (<= 1e-12). The tiny 4-layer config of tests/reference/test_glm_parity.py, sparse regime."""

from __future__ import annotations

import json
import os
import sys

from launch import longstraw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

PPO = ("device=cpu", "model.dtype=float64", "grpo.objective=ppo", "ppo.gamma=0.9", "ppo.lam=0.8", "ppo.value_clip=0.3")


def _validate(n, d, out, *extra):
    r = longstraw(n, "validate", "--hf", str(d / "policy"), "--rollouts", str(d / "r.jsonl"), "--out", str(out),
                  "--mode", "exact", "--dump-grads", "--critic", str(d / "critic"), *PPO, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "receipt.json").read_text())


def test_glm_ppo_equals_transformers_and_ep2_equals_one_rank(tmp_path):
    from compare_validate import compare
    from ppo_reference import grads, reference, write_glm
    from safetensors.torch import load_file
    from test_glm_parity import _configs

    from longstraw_mcore.data.rollouts import load_rollouts

    hf_cfg, _ = _configs(topk=4)
    policy, critic = write_glm(tmp_path, hf_cfg)
    groups = load_rollouts(tmp_path / "r.jsonl", hf_cfg.vocab_size)
    got = _validate(1, tmp_path, tmp_path / "one")
    ref = reference(policy, critic, groups, "exact", gamma=0.9, lam=0.8, vf_coef=0.5, clip=0.3)
    diff = {k: max(abs(x - y) for g1, g2 in zip(got[k], ref[k]) for b1, b2 in zip(g1, g2) for x, y in zip(b1, b2))
            for k in ("values", "advantages", "returns", "logprobs")}
    diff.update(loss=abs(got["loss"] - ref["loss"]), value_loss=abs(got["value_loss"] - ref["value_loss"]))
    for name, model, file in (("policy", policy, "grads.safetensors"), ("critic", critic, "critic_grads.safetensors")):
        mine, want = load_file(str(tmp_path / "one" / file)), grads(model)
        shared = set(mine) & set(want)  # (the indexer and the router bias take no gradient: absent or zero)
        assert {"score.weight", "score.bias"} <= shared or name == "policy"
        diff[f"{name}_grad"] = max(float((mine[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300))
                                   for k in shared if float(want[k].abs().max()) > 0)
    print(f"GLM PPO one rank vs transformers: {diff}")
    assert max(diff.values()) <= 1e-10
    _validate(4, tmp_path, tmp_path / "ep2", "parallel.ep=2")
    ep = compare(tmp_path / "ep2", tmp_path / "one")
    print(f"EP=2 x DP=2 vs one rank: {ep}")
    assert max(v for k, v in ep.items() if isinstance(v, float) and not k.endswith("grad_worst")) <= 1e-12
    assert ep["grad_worst"] <= 1e-10 and ep["critic_grad_worst"] <= 1e-10
