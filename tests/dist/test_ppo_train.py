"""`longstraw train grpo.objective=ppo --critic DIR` on 2 ranks (TP=2): the critic trains in the same step
with its own optimizer and checkpoints (--save DIR/critic/step_N, written before the policy's step); a
resume continues bit for bit (policy loss, value loss, both gradient norms); a step whose critic
checkpoint is missing is not resumed from (the newest step with both is); `--reward-model` scores the
responses in place of the rollouts' rewards; `validate --load ck/step_2 --critic ck/critic/step_2` (the
Megatron checkpoints, at one rank) gives step 3's losses. A QLoRA critic (NF4 base, adapters, its value head
trained whole) checkpoints as a PEFT directory and resumes bit for bit. Float32 (train's dtype)."""

from __future__ import annotations

import json
import shutil

from launch import longstraw_forked as longstraw  # noqa: E402 (ranks forked preloaded: the CLI's main())

KEYS = ("loss", "value_loss", "grad_norm", "critic_grad_norm", "reward_mean", "clip_frac", "value_clip_frac")


def _train(d, ck, metrics, steps, *extra):
    r = longstraw(2, "train", "--hf", str(d / "policy"), "--rollouts", str(d / "r.jsonl"), "--critic",
                  str(d / "critic"), "--reward-model", str(d / "rm"), "--steps", str(steps), "--save", str(ck),
                  "--metrics-out", str(metrics), "device=cpu", "model.dtype=float32", "grpo.objective=ppo",
                  "parallel.tp=2", "train.lr=1e-3", "ppo.critic_lr=3e-3", "train.save_every=2", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_ppo_train_resumes_with_its_critic_bit_for_bit(tmp_path):
    from hf_reference import tiny_model_config
    from ppo_reference import write_models_and_rollouts

    d = tmp_path
    write_models_and_rollouts(d, tiny_model_config())
    ck, m = d / "ck", d / "m.jsonl"
    _train(d, ck, m, 4)
    first = [json.loads(ln) for ln in m.read_text().splitlines()]
    assert sorted(p.name for p in (ck / "critic").glob("step_*")) == ["step_000002", "step_000004"]
    shutil.rmtree(ck / "critic" / "step_000004")  # a death between the critic's and the policy's publication
    r = _train(d, ck, m, 4, "--resume")
    again = [json.loads(ln) for ln in m.read_text().splitlines()][4:]
    print(f"first run {[{k: x[k] for k in KEYS} for x in first]}; resumed steps {[x['step'] for x in again]}")
    assert "the critic's checkpoint of step 4: missing" in r.stdout + r.stderr
    assert [x["step"] for x in again] == [3, 4]
    assert all(x["critic_update_ok"] and x["update_ok"] for x in first + again)
    assert [[x[k] for k in KEYS] for x in again] == [[x[k] for k in KEYS] for x in first[2:]]
    assert len({x["reward_mean"] for x in first}) == 2  # (the reward model's scores: two groups alternate)

    # the critic from its Megatron checkpoint, at another layout: step 3 trained on group 0 from step 2's weights
    one = d / "g0.jsonl"
    one.write_text((d / "r.jsonl").read_text().splitlines()[0] + "\n")
    meta = json.loads((ck / "step_000002" / "longstraw_model.json").read_text())
    (d / "model.json").write_text(json.dumps({"model": meta["model"]}))  # (YAML reads JSON)
    r = longstraw(1, "validate", "--load", str(ck / "step_000002"), "--config", str(d / "model.json"),
                  "--rollouts", str(one), "--out", str(d / "v"), "--critic",
                  str(ck / "critic" / "step_000002"), "--reward-model", str(d / "rm"), "device=cpu",
                  "model.dtype=float32", "grpo.objective=ppo")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((d / "v" / "receipt.json").read_text())
    step3 = first[2]
    print(f"validate from step 2's checkpoints: loss {got['loss']} value loss {got['value_loss']}; step 3 "
          f"{step3['loss']} {step3['value_loss']}")
    assert abs(got["loss"] - step3["loss"]) <= 1e-5 * max(1.0, abs(step3["loss"]))
    assert abs(got["value_loss"] - step3["value_loss"]) <= 1e-5 * max(1.0, abs(step3["value_loss"]))


def test_ppo_train_qlora_critic_resumes_bit_for_bit(tmp_path):
    """A QLoRA critic (`--critic policy critic_adapter.rank=4 critic_adapter.base_dtype=nf4`: the policy's
    weights as an NF4 base, a new value head trained whole beside rank-4 adapters) beside a full-parameter
    policy, DP=2: its checkpoint is a PEFT token-classification directory (the factors and `score`), and a
    resume from step 2 repeats step 3 bit for bit."""
    from hf_reference import tiny_model_config
    from ppo_reference import write_models_and_rollouts

    d = tmp_path
    write_models_and_rollouts(d, tiny_model_config())
    ck, m = d / "ck", d / "m.jsonl"

    def run(steps, *extra):
        r = longstraw(2, "train", "--hf", str(d / "policy"), "--rollouts", str(d / "r.jsonl"), "--critic", "policy",
                      "--steps", str(steps), "--save", str(ck), "--metrics-out", str(m), "device=cpu",
                      "model.dtype=float32", "grpo.objective=ppo", "critic_adapter.rank=4",
                      "critic_adapter.base_dtype=nf4", "train.lr=1e-3", "ppo.critic_lr=3e-3", "train.save_every=1",
                      "train.groups_per_step=2", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    r = run(3)
    first = [json.loads(ln) for ln in m.read_text().splitlines()]
    assert "[critic] LoRA r=4 alpha=16 base nf4" in r.stdout
    adapter = ck / "critic" / "step_000003" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    assert cfg["task_type"] == "TOKEN_CLS" and cfg["modules_to_save"] == ["score"] and cfg["r"] == 4
    assert {"base_model.model.score.weight", "base_model.model.score.bias"} <= keys
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in keys if "score" not in k)
    # the adapters alone are no critic: their base is named beside them
    r = longstraw(1, "validate", "--hf", str(d / "policy"), "--rollouts", str(d / "r.jsonl"), "--out", str(d / "v"),
                  "--critic", str(ck / "critic" / "step_000003"), "device=cpu", "grpo.objective=ppo")
    assert r.returncode == 2 and "a checkpoint of adapters alone; give their base as --critic and the adapters " \
        f"as --critic-adapter {adapter}" in r.stderr, r.stderr[-2000:]
    shutil.rmtree(ck / "step_000003")
    run(3, "--resume")
    again = [json.loads(ln) for ln in m.read_text().splitlines()][3:]
    print(f"QLoRA critic: first run {[{k: x[k] for k in KEYS} for x in first]}; resumed {again[0]['step']}")
    assert all(x["critic_update_ok"] and x["update_ok"] for x in first + again)
    assert first[0]["critic_grad_norm"] > 0 and first[2]["value_loss"] != first[0]["value_loss"]
    assert [x["step"] for x in again] == [3]
    assert [again[0][k] for k in KEYS] == [first[2][k] for k in KEYS]
