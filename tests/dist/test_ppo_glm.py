"""PPO with a GLM-5.x critic (MLA + DSA + MoE; the token-classification layout under GLM's names:
`model.*` + `score.weight`, `score.bias`), float64, exact mode: at one rank against transformers'
GlmMoeDsaForCausalLM and GlmMoeDsaModel + a score Linear run as full sequences (tests/ppo_reference.py),
<= 1e-10; at EP=2 (x DP=2, experts split, the MoE all-to-alls in lockstep for the critic too) equal to
one rank (<= 1e-12). A LoRA critic (a PEFT token-classification directory on the same base) against PEFT
the same way, and at EP=2. The tiny 4-layer config of tests/reference/test_glm_parity.py, sparse regime."""

from __future__ import annotations

import json
import os
import sys

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))

PPO = ("device=cpu", "model.dtype=float64", "grpo.objective=ppo", "ppo.gamma=0.9", "ppo.lam=0.8", "ppo.value_clip=0.3")


def _validate(n, d, out, *extra):
    r = longstraw(n, "validate", "--hf", str(d / "policy"), "--rollouts", str(d / "r.jsonl"), "--out", str(out),
                  "--mode", "exact", "--dump-grads", "--critic", str(d / "critic"), *PPO, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "receipt.json").read_text())


def _against(got, out, ref, policy, critic, critic_grads):
    from ppo_reference import grads
    from safetensors.torch import load_file

    diff = {k: max(abs(x - y) for g1, g2 in zip(got[k], ref[k]) for b1, b2 in zip(g1, g2) for x, y in zip(b1, b2))
            for k in ("values", "advantages", "returns", "logprobs")}
    diff.update(loss=abs(got["loss"] - ref["loss"]), value_loss=abs(got["value_loss"] - ref["value_loss"]))
    for name, want, file in (("policy", grads(policy), "grads.safetensors"),
                             ("critic", critic_grads(critic), "critic_grads.safetensors")):
        mine = load_file(str(out / file))
        shared = set(mine) & set(want)  # (the indexer and the router bias take no gradient: absent or zero)
        assert {"score.weight", "score.bias"} <= {k.removeprefix("base_model.model.") for k in shared} \
            or name == "policy"
        if name == "critic" and critic_grads is not grads:  # (the adapters' names are PEFT's on both sides)
            assert set(want) == set(mine), sorted(set(want) ^ set(mine))[:4]
        diff[f"{name}_grad"] = max(float((mine[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300))
                                   for k in shared if float(want[k].abs().max()) > 0)
    return diff


def _ep2(d, out, one, *extra):
    from compare_validate import compare

    _validate(4, d, out, "parallel.ep=2", *extra)
    ep = compare(out, one)
    assert max(v for k, v in ep.items() if isinstance(v, float) and not k.endswith("grad_worst")) <= 1e-12, ep
    assert ep["grad_worst"] <= 1e-10 and ep["critic_grad_worst"] <= 1e-10, ep
    return ep


def test_glm_ppo_equals_transformers_and_ep2_equals_one_rank(tmp_path):
    from ppo_reference import grads, peft_critic, peft_grads, reference, write_glm
    from test_glm_parity import _configs

    from longstraw_mcore.data.rollouts import load_rollouts

    hf_cfg, _ = _configs(topk=4)
    policy, critic = write_glm(tmp_path, hf_cfg)
    groups = load_rollouts(tmp_path / "r.jsonl", hf_cfg.vocab_size)
    got = _validate(1, tmp_path, tmp_path / "one")
    ref = reference(policy, critic, groups, "exact", gamma=0.9, lam=0.8, vf_coef=0.5, clip=0.3)
    diff = _against(got, tmp_path / "one", ref, policy, critic, grads)
    print(f"GLM PPO one rank vs transformers: {diff}")
    assert max(diff.values()) <= 1e-10
    print(f"EP=2 x DP=2 vs one rank: {_ep2(tmp_path, tmp_path / 'ep2', tmp_path / 'one')}")

    # a LoRA critic (PEFT's token-classification directory; kv_b_proj is the one MLA absorbs) on the same base
    pc = peft_critic(critic, tmp_path / "critic_lora", ["q_b_proj", "kv_b_proj", "o_proj"], 4, 8.0, seed=7)
    lora = ("--critic-adapter", str(tmp_path / "critic_lora"))
    got = _validate(1, tmp_path, tmp_path / "one_lora", *lora)
    policy.zero_grad(set_to_none=True)
    ref = reference(policy, pc, groups, "exact", gamma=0.9, lam=0.8, vf_coef=0.5, clip=0.3)
    diff = _against(got, tmp_path / "one_lora", ref, policy, pc, peft_grads)
    print(f"GLM LoRA critic one rank vs PEFT: {diff}")
    assert max(diff.values()) <= 1e-10
    print(f"LoRA critic EP=2 x DP=2 vs one rank: {_ep2(tmp_path, tmp_path / 'ep2_lora', tmp_path / 'one_lora', *lora)}")
