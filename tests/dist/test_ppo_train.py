"""`longstraw train grpo.objective=ppo --critic DIR` on 2 ranks (TP=2): the critic trains in the same step
with its own optimizer and checkpoints (--save DIR/critic/step_N, written before the policy's step); a
resume continues bit for bit (policy loss, value loss, both gradient norms); a step whose critic
checkpoint is missing is not resumed from (the newest step with both is); `--reward-model` scores the
responses in place of the rollouts' rewards; `validate --load ck/step_2 --critic ck/critic/step_2` (the
Megatron checkpoints, at one rank) gives step 3's losses. Float32 (train's dtype)."""

from __future__ import annotations

import json
import shutil

from launch import longstraw

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
