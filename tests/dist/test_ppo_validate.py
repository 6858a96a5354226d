"""PPO with a critic through branch replay (`validate --critic DIR grpo.objective=ppo`), float64, against
transformers' models (Qwen3_5ForCausalLM, Qwen3_5ForTokenClassification with one label, and a
Qwen3_5TextForSequenceClassification reward model) run as full sequences with autograd, PPO's losses
computed per sequence in tests/ppo_reference.py:

- one rank, exact mode, rewards from `--reward-model`: the reward model's scores equal the reference's
  full-sequence scores (<= 1e-12); the policy's and the critic's gradients (`score.*` included), the
  values, advantages, returns, log-probs and both losses equal the reference (<= 1e-10); group 0's
  responses share a prefix, replayed once (a prefix tree), the reference replays them flat; group 1 has
  a loss mask, old log-probs, old values and a KL reward (grpo.beta > 0, reference log-probs);
- one rank, detached mode, against transformers' prompt-cache path (the prompt a no-grad constant);
- TP=2 x CP=2 and PP=2 equal one rank (<= 1e-12);
- a LoRA critic (`--critic-adapter`, a directory PEFT wrote) equals PEFT's autograd at one rank, and
  TP=2 x PP=2 equals one rank."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

PPO = ("device=cpu", "model.dtype=float64", "grpo.objective=ppo", "grpo.beta=0.05", "ppo.gamma=0.9", "ppo.lam=0.8",
       "ppo.vf_coef=0.7", "ppo.value_clip=0.3")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from hf_reference import tiny_model_config
    from ppo_reference import write_models_and_rollouts

    from longstraw_mcore.data.rollouts import load_rollouts

    d = tmp_path_factory.mktemp("ppo")
    m = tiny_model_config()
    policy, critic, rm = write_models_and_rollouts(d, m, tree=True)
    return d, policy, critic, rm, load_rollouts(d / "r.jsonl", m.vocab_size)


def _validate(n, d, out, mode, *extra):
    r = longstraw(n, "validate", "--hf", str(d / "policy"), "--rollouts", str(d / "r.jsonl"), "--out", str(out),
                  "--mode", mode, "--dump-grads", "--critic", str(d / "critic"), *PPO, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "receipt.json").read_text())


def _against(receipt, out, ref, policy, critic, critic_grads=None):
    from ppo_reference import grads
    from safetensors.torch import load_file

    def worst(a, b):
        return max(abs(x - y) for ga, gb in zip(a, b) for ba, bb in zip(ga, gb) for x, y in zip(ba, bb))

    diff = {k: worst(receipt[k], ref[k]) for k in ("values", "advantages", "returns", "logprobs")}
    diff["loss"] = abs(receipt["loss"] - ref["loss"])
    diff["value_loss"] = abs(receipt["value_loss"] - ref["value_loss"])
    for name, want, file in (("policy", grads(policy), "grads.safetensors"),
                             ("critic", (critic_grads or grads)(critic), "critic_grads.safetensors")):
        got = load_file(str(out / file))
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
        diff[f"{name}_grad"] = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    assert {"score.weight", "score.bias"} <= {k.removeprefix("base_model.model.") for k in got}
    return diff


def test_ppo_equals_transformers_exact_with_a_reward_model_and_detached(case, tmp_path):
    from ppo_reference import reference, reward_scores

    d, policy, critic, rm, groups = case
    got = _validate(1, d, tmp_path / "exact", "exact", "--reward-model", str(d / "rm"))
    scores = reward_scores(rm, groups)
    score_diff = max(abs(a - b) for g1, g2 in zip(got["reward_model_scores"], scores) for a, b in zip(g1, g2))
    scored = [dataclasses.replace(g, rewards=s) for g, s in zip(groups, scores)]
    kw = dict(gamma=0.9, lam=0.8, vf_coef=0.7, clip=0.3, beta=0.05)
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    exact = _against(got, tmp_path / "exact", reference(policy, critic, scored, "exact", **kw), policy, critic)
    print(f"reward model scores vs full sequences {score_diff:.1e}; exact vs full sequences {exact}; "
          f"{got['replayed_tokens']} of {got['response_tokens']} response tokens replayed (prefix tree)")
    assert score_diff <= 1e-12 and max(exact.values()) <= 1e-10
    assert got["replayed_tokens"] < got["response_tokens"]  # group 0's shared prefix replayed once

    got = _validate(1, d, tmp_path / "detached", "detached")
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    det = _against(got, tmp_path / "detached", reference(policy, critic, groups, "detached", **kw), policy, critic)
    print(f"detached vs transformers' prompt cache {det}")
    assert max(det.values()) <= 1e-10


def test_ppo_layouts_equal_one_rank(case, tmp_path):
    from compare_validate import compare

    d = case[0]
    _validate(1, d, tmp_path / "one", "exact")
    for name, n, layout in (("tp2cp2", 4, ("parallel.tp=2", "parallel.cp=2")), ("pp2", 2, ("parallel.pp=2",))):
        _validate(n, d, tmp_path / name, "exact", *layout)
        diff = compare(tmp_path / name, tmp_path / "one")
        print(f"{name} vs one rank: {diff}")
        assert max(v for k, v in diff.items() if isinstance(v, float) and not k.endswith("grad_worst")) <= 1e-12
        # (each tensor against its own largest entry: tools/compare_validate.py)
        assert diff["grad_worst"] <= 1e-10 and diff["critic_grad_worst"] <= 1e-10


def test_ppo_critic_lora_equals_peft_and_layouts(case, tmp_path):
    """A LoRA critic (--critic-adapter: a PEFT token-classification directory written by PEFT itself, its
    score kept whole) on the transformers critic's frozen base: values, advantages, losses, the policy's
    gradients and the critic's adapter and score gradients equal PEFT's full-sequence autograd (<= 1e-10)
    at one rank in exact mode; TP=2 x PP=2 (the factors sharded, the score on the last stage) equals one
    rank (<= 1e-12, each tensor against its own largest entry <= 1e-10)."""
    from compare_validate import compare
    from ppo_reference import peft_critic, peft_grads, reference

    d, policy, critic, _, groups = case
    pc = peft_critic(critic, d / "critic_lora", ["q_proj", "in_proj_qkv", "down_proj"], 4, 8.0, seed=11)
    lora = ("--critic-adapter", str(d / "critic_lora"))
    got = _validate(1, d, tmp_path / "one", "exact", *lora)
    policy.zero_grad(set_to_none=True)
    kw = dict(gamma=0.9, lam=0.8, vf_coef=0.7, clip=0.3, beta=0.05)
    diff = _against(got, tmp_path / "one", reference(policy, pc, groups, "exact", **kw), policy, pc, peft_grads)
    print(f"LoRA critic vs PEFT, full sequences: {diff}")
    assert max(diff.values()) <= 1e-10
    _validate(4, d, tmp_path / "tp2pp2", "exact", "parallel.tp=2", "parallel.pp=2", *lora)
    diff = compare(tmp_path / "tp2pp2", tmp_path / "one")
    print(f"LoRA critic, TP=2 x PP=2 vs one rank: {diff}")
    assert max(v for k, v in diff.items() if isinstance(v, float) and not k.endswith("grad_worst")) <= 1e-12
    assert diff["grad_worst"] <= 1e-10 and diff["critic_grad_worst"] <= 1e-10
