"""Bad run-level input is refused before any work: exit status 2, one line on stderr naming the value
(no traceback), nothing written, Megatron never imported. Also: `--resume` with nothing left to do exits 0
and says so, and `longstraw check` answers for a layout. Every case runs through the CLI's `main()` in one
fresh interpreter (tests/cli_in_process.py: the exit status, what reached file descriptors 1 and 2, and whether
the case imported Megatron, per case), not a process each: the checks are the same, the interpreter and
torch's import are paid once instead of 43 times."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
TINY = "configs/qwen3.6-tiny.yaml"


def _rollouts(path, groups):
    path.write_text("".join(json.dumps(g) + "\n" for g in groups))
    return str(path)


def _hf_config(d, **changes):
    from longstraw_mcore.checkpoint.qwen3_5 import hf_config_dict
    from longstraw_mcore.config import load_config

    raw = hf_config_dict(load_config(os.path.join(ROOT, TINY)).model)
    for k, v in changes.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def _peft_dir(d, hidden):
    """A PEFT-format adapter (r=4) whose in_proj_z expects another hidden size."""
    import torch
    from safetensors.torch import save_file

    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                      "target_modules": ["in_proj_z"]}))
    save_file({"base_model.model.model.layers.0.linear_attn.in_proj_z.lora_A.weight": torch.zeros(4, hidden),
               "base_model.model.model.layers.0.linear_attn.in_proj_z.lora_B.weight": torch.zeros(64, 4)},
              str(d / "adapter_model.safetensors"))
    return str(d)


G2 = {"prompt": [1, 2, 3], "responses": [[4, 5], [6]], "rewards": [0.0, 1.0]}


def _cases(tmp):
    r3 = _rollouts(tmp / "g3.jsonl", [G2, {"prompt": [1], "responses": [[2], [3], [4]], "rewards": [0, 1, 2]}])
    eq = _rollouts(tmp / "eq.jsonl", [{**G2, "rewards": [0.5, 0.5]}])
    ok = _rollouts(tmp / "ok.jsonl", [G2])
    with_ref = _rollouts(tmp / "ref.jsonl", [{**G2, "ref_logprobs": [[-1.0, -2.0], [-1.5]]}])
    ckpt = tmp / "ckpt"
    (ckpt / "step_000004").mkdir(parents=True)
    (ckpt / "step_000004" / "manifest.json").write_text(json.dumps({"files": {}}))
    bad = tmp / "bad"
    (bad / "step_000003").mkdir(parents=True)
    (bad / "step_000003" / "shard.distcp").write_bytes(b"12345")
    (bad / "step_000003" / "manifest.json").write_text(json.dumps({"files": {"shard.distcp": 10}}))
    train = ["train", "--config", TINY, "--steps", "1"]
    pol = _hf_config(tmp / "policy")
    return [
        ("dpo G=3", train + ["--rollouts", r3, "grpo.objective=dpo"],
         "group 1: DPO needs exactly 2 responses (chosen, rejected), got 3"),
        ("dpo equal rewards", train + ["--rollouts", eq, "grpo.objective=dpo"],
         "group 0: DPO needs different rewards to tell chosen from rejected, got [0.5, 0.5]"),
        ("beta without reference", train + ["--rollouts", ok, "grpo.beta=0.1"],
         "grpo.beta=0.1: group 0 has no ref_logprobs"),
        ("unused reference (dpo)", train + ["--rollouts", with_ref, "--ref-load", str(tmp), "grpo.objective=dpo"],
         "every group carries ref_logprobs, so it would be unused"),
        ("unused reference (beta 0)", train + ["--rollouts", ok, "--ref-load", str(tmp)],
         "grpo.beta=0 (no KL term), so it would be unused"),
        ("train in float64", train + ["--rollouts", ok, "model.dtype=float64"],
         "model.dtype=float64: `longstraw train` with train.grad_reduction=step needs float32 or bfloat16"),
        ("config.json missing a field", ["train", "--hf", _hf_config(tmp / "nohidden", hidden_size=None),
                                         "--rollouts", ok, "--steps", "1"],
         "lacks required field(s) ['hidden_size']"),
        ("float16 checkpoint", ["validate", "--hf", _hf_config(tmp / "fp16", dtype="float16"), "--rollouts", ok,
                                "--out", str(tmp / "out_fp16")],
         "model.dtype=float16: runs use bfloat16, float32 or float64"),
        ("unknown dtype", ["validate", "--hf", _hf_config(tmp / "fp8", dtype="float8_e4m3fn"), "--rollouts", ok,
                           "--out", str(tmp / "out_fp8")],
         "dtype 'float8_e4m3fn' is not one of"),
        ("save dir holds checkpoints", train + ["--rollouts", ok, "--save", str(ckpt)],
         "already holds checkpoints (newest step_000004); pass --resume"),
        ("damaged checkpoint, nothing to fall back to", train + ["--rollouts", ok, "--save", str(bad), "--resume",
                                                                 "--steps", "9"],
         f"{bad}/step_000003/shard.distcp: 5 bytes, the manifest records 10"),
        ("resume without save", train + ["--rollouts", ok, "--resume"], "--resume needs --save DIR"),
        ("pipeline split that does not add up", train + ["--rollouts", ok, "parallel.pp=2", "parallel.pp_layers=[3,4]"],
         "parallel.pp_layers=[3, 4] adds up to 7 layers but model.num_layers=8"),
        ("pipeline split with the wrong stage count", train + ["--rollouts", ok, "parallel.pp=2",
                                                               "parallel.pp_layers=[2,3,3]"],
         "parallel.pp_layers=[2, 3, 3] has 3 stages but parallel.pp=2"),
        ("layers the stages do not divide", train + ["--rollouts", ok, "parallel.pp=3"],
         "model.num_layers=8 is not divisible by parallel.pp=3; set parallel.pp_layers"),
        ("pipeline the launch does not fit", train + ["--rollouts", ok, "parallel.pp=2"],
         "world size 1 is not divisible by tp*pp*cp = 1*2*1 = 2"),
        ("pipeline the world size does not fit", ["check", "--config", TINY, "--world-size", "6", "parallel.pp=4",
                                                  "parallel.tp=2"],
         "world size 6 is not divisible by tp*pp*cp = 2*4*1 = 8"),
        ("prompt shorter than the CP size", ["check", "--config", TINY, "--world-size", "4", "--rollouts", ok,
                                             "parallel.cp=4", "model.linear_num_key_heads=4",
                                             "model.linear_num_value_heads=8"],
         "group 0: prompt of 3 tokens is too short for parallel.cp=4"),
        ("CP by heads that GDN heads do not split", train + ["--rollouts", ok, "parallel.cp=4", "model.gdn_cp=heads"],
         "model.gdn_cp=heads: model.linear_num_key_heads=2 is not divisible by parallel.tp*parallel.cp=1*4"),
        ("CP the world size does not fit", ["check", "--config", TINY, "--world-size", "3", "parallel.cp=2"],
         "world size 3 is not divisible by tp*pp*cp = 1*1*2 = 2"),
        ("adapter target the model lacks", train + ["--rollouts", ok, "adapter.rank=4", "adapter.targets=[q_proj,wq]"],
         "adapter.targets: ['wq'] are not projections of the qwen3_5 family"),
        ("adapter rank beyond a target", train + ["--rollouts", ok, "adapter.rank=5", "adapter.targets=[in_proj_b]"],
         "adapter.rank=5: exceeds the smaller dimension 4 of in_proj_b [4, 64]"),
        ("adapter alpha", train + ["--rollouts", ok, "adapter.rank=4", "adapter.alpha=0"],
         "adapter.alpha=0.0: must be > 0"),
        ("reuse without a frozen prompt", train + ["--rollouts", ok, "adapter.rank=4", "replay.reuse_steps=4"],
         "replay.reuse_steps=4: one capture serves several optimizer steps only when"),
        ("adapter of another model", train + ["--rollouts", ok, "--adapter", _peft_dir(tmp / "wrong_peft", 7)],
         "model.layers.0.linear_attn.in_proj_z: lora_A [4, 7]"),
        ("not an adapter directory", train + ["--rollouts", ok, "--adapter", str(tmp)],
         "adapter_config.json"),
        ("ppo without a critic", ["validate", "--hf", pol, "--rollouts", ok, "--out", str(tmp / "o1"),
                                  "grpo.objective=ppo"],
         "grpo.objective=ppo needs a critic: --critic DIR"),
        ("critic whose vocabulary misses the policy's tokens",
         ["validate", "--hf", pol, "--rollouts", ok, "--out", str(tmp / "o2"), "grpo.objective=ppo", "--critic",
          _hf_config(tmp / "small_critic", vocab_size=100, architectures=["Qwen3_5ForTokenClassification"])],
         "its vocabulary of 100 does not hold the policy's tokens (ids up to 511)"),
        ("a language model given as the critic", ["validate", "--hf", pol, "--rollouts", ok, "--out", str(tmp / "o3"),
                                                  "grpo.objective=ppo", "--critic", pol],
         "is a policy (--hf, --ref-hf), but it was given as a critic (--critic)"),
        ("gamma outside [0, 1]", train + ["--rollouts", ok, "grpo.objective=ppo", "ppo.gamma=1.5"],
         "ppo.gamma=1.5: must be in [0, 1]"),
        ("lambda outside [0, 1]", train + ["--rollouts", ok, "grpo.objective=ppo", "ppo.lam=-0.1"],
         "ppo.lam=-0.1: must be in [0, 1]"),
        ("interleaved stages without a pipeline", train + ["--rollouts", ok, "parallel.vpp=2"],
         "parallel.vpp=2 needs parallel.pp > 1"),
        ("virtual stages the layers do not fill", ["check", "--config", TINY, "--world-size", "2", "parallel.pp=2",
                                                   "parallel.vpp=3"],
         "model.num_layers=8 is not divisible by parallel.pp x parallel.vpp = 6"),
        ("a layer count per rank at vpp 2", ["check", "--config", TINY, "--world-size", "2", "parallel.pp=2",
                                            "parallel.vpp=2", "parallel.pp_layers=[4,4]"],
         "give one layer count per virtual stage (pp x vpp = 4)"),
        ("interleaved stages with PPO", train + ["--rollouts", ok, "parallel.pp=2", "parallel.vpp=2",
                                                 "grpo.objective=ppo"],
         "parallel.vpp=2: interleaved stages run with Megatron's plain optimizer or train.grad_reduction=micro_step, "
         "not yet with grpo.objective=ppo"),
        ("critic adapters without PPO", train + ["--rollouts", ok, "critic_adapter.rank=4"],
         "critic_adapter.rank=4: adapters on a critic, which only grpo.objective=ppo uses"),
        ("a critic adapter without a critic", train + ["--rollouts", ok, "--critic-adapter", str(tmp)],
         f"--critic-adapter {tmp}: needs --critic"),
        ("lm_head on a critic", train + ["--rollouts", ok, "grpo.objective=ppo", "critic_adapter.rank=4",
                                         "critic_adapter.targets=[q_proj,lm_head]"],
         "critic_adapter.targets: lm_head is not a critic's"),
        ("a critic adapter of another model (read from the file's header)",
         train + ["--rollouts", ok, "grpo.objective=ppo", "--critic", "policy", "--critic-adapter",
                  _peft_dir(tmp / "wrong_critic_peft", 7)],
         "model.layers.0.linear_attn.in_proj_z: lora_A [4, 7]"),
        ("critic adapter rank beyond a target", train + ["--rollouts", ok, "critic_adapter.rank=5",
                                                          "critic_adapter.targets=[in_proj_b]"],
         "critic_adapter.rank=5: exceeds the smaller dimension 4 of in_proj_b"),
    ]


CHECKS = [("8 ranks at tp=4", ["parallel.tp=4"], 8, True), ("6 ranks at tp=4", ["parallel.tp=4"], 6, False)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case of this file through `main()` in one interpreter: (tmp dir, bad cases, their results,
    the resume case's result, the check cases' results)."""
    from cli_in_process import run_cases

    tmp = tmp_path_factory.mktemp("cli")
    cases = _cases(tmp)
    done = tmp / "done"
    (done / "step_000004").mkdir(parents=True)
    (done / "step_000004" / "manifest.json").write_text(json.dumps({"files": {}}))
    resume = ["train", "--config", TINY, "--rollouts", _rollouts(tmp / "ok2.jsonl", [G2]), "--save", str(done),
              "--resume", "--steps", "4"]
    checks = [["check", "--config", "configs/qwen3.6-27b.yaml", "--world-size", str(w), *o] for _, o, w, _ in CHECKS]
    res = run_cases([c[1] for c in cases] + [resume] + checks)
    return tmp, cases, res[:len(cases)], res[len(cases)], res[len(cases) + 1:]


def test_each_bad_input_exits_2_with_one_line(runs):
    tmp_path, cases, results = runs[:3]
    for (name, args, needle), r in zip(cases, results):
        lines = r["stderr"].strip().splitlines()
        assert r["code"] == 2, (name, r["code"], r["stderr"][-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (name, r["stderr"])
        assert "Traceback" not in r["stderr"] and r["stdout"] == "", (name, r["stdout"])
        assert not r["imported_megatron"], f"{name}: Megatron was imported before the input was refused"
    assert not (tmp_path / "out_fp16").exists() and not (tmp_path / "out_fp8").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000004"]


def test_resume_with_nothing_left_to_do_exits_0(runs):
    r = runs[3]
    assert r["code"] == 0, r["stderr"][-2000:]
    assert "complete checkpoint at step 4 >= --steps 4: nothing to do" in r["stdout"]


@pytest.mark.parametrize("i", range(len(CHECKS)), ids=[c[0] for c in CHECKS])
def test_check_command(runs, i):
    r, ok = runs[4][i], CHECKS[i][3]
    if ok:
        assert r["code"] == 0 and "[check] ok: `longstraw train`" in r["stdout"] and "dp=2 on 8 ranks" in r["stdout"], \
            r["stderr"]
    else:
        assert r["code"] == 2 and "world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4" in r["stderr"]
