"""The planner's PPO critic (planner/memory.critic_terms, planner/timing.py): the critic's weights are the
policy's with `score` [1, H] + bias (whole on every TP rank, last stage only) in place of the padded
vocabulary's output layer; its gradient buffer and Adam state follow the policy's formulas; nothing
else changes (its state and activations: the policy's bound them, time-shared); its pass adds the
policy's phases again to the time. No model, no process group."""

from __future__ import annotations

import pytest

from longstraw_mcore.config import load_config
from longstraw_mcore.families import get_family
from longstraw_mcore.planner.memory import plan_both, stage_plan
from longstraw_mcore.planner.timing import plan_time
from longstraw_mcore.planner.devices import device_profile


@pytest.mark.parametrize("over", [["parallel.tp=2"], ["parallel.pp=2"], ["model.dtype=bfloat16", "parallel.tp=2"]])
def test_critic_terms(over):
    grpo = load_config("configs/qwen3.6-tiny.yaml", over)
    ppo = load_config("configs/qwen3.6-tiny.yaml", over + ["grpo.objective=ppo"])
    fam = get_family("qwen3_5")
    m, tp, pp = grpo.model, grpo.parallel.tp, grpo.parallel.pp
    e = 2 if m.dtype == "bfloat16" else 4
    for stage in range(pp):  # every pipeline stage's rank: the head lives on the last
        a, _ = stage_plan(fam, grpo, 256, 16, 4, 2, stage, False)
        b, host = stage_plan(fam, ppo, 256, 16, 4, 2, stage, False)
        last = stage == pp - 1
        head_delta = (m.hidden_size + 1 - m.padded_vocab_size(tp) * m.hidden_size // tp) * e if last else 0
        assert b["critic_weights"] == a["weights"] + head_delta
        n = b["critic_weights"] // e
        assert b["critic_gradients"] == n * 4  # (a float32 buffer below float32 models)
        assert b["critic_optimizer"] == n * 8 + (n * 4 if m.dtype == "bfloat16" else 0)
        assert {k: v for k, v in b.items() if not k.startswith("critic_")} == a
        assert host["critic_optimizer"] == 0
    dev, host = plan_both(fam, ppo, 256, 16, 4, 2)
    t = plan_time(fam, ppo, 256, 16, 4, 2, device_profile("H20-96GB"), None, host)["seconds"]
    assert t["critic"] == pytest.approx(t["capture"] + t["replay"])


def test_qlora_critic_terms_are_a_qlora_policys():
    """critic_adapter.rank > 0: the critic's weights, gradients and Adam state are those of a policy with the
    same `adapter` section (its frozen base at critic_adapter.base_dtype, only the adapters trained), the
    output layer swapped for the value head; the policy's own terms do not change."""
    over = ["parallel.tp=2", "model.dtype=bfloat16"]
    qlora = ["rank=4", "base_dtype=nf4", "targets=[q_proj,in_proj_qkv,down_proj]"]
    full = load_config("configs/qwen3.6-tiny.yaml", over + ["grpo.objective=ppo"])
    ppo = load_config("configs/qwen3.6-tiny.yaml", over + ["grpo.objective=ppo"] + [f"critic_adapter.{x}" for x in qlora])
    like = load_config("configs/qwen3.6-tiny.yaml", over + [f"adapter.{x}" for x in qlora])
    fam = get_family("qwen3_5")
    m = ppo.model
    a, _ = stage_plan(fam, full, 256, 16, 4, 2, 0, False)
    b, _ = stage_plan(fam, ppo, 256, 16, 4, 2, 0, False)
    c, _ = stage_plan(fam, like, 256, 16, 4, 2, 0, False)
    head_delta = (m.hidden_size + 1 - m.padded_vocab_size(2) * m.hidden_size // 2) * 2
    assert b["critic_weights"] == c["weights"] + head_delta < a["critic_weights"]
    assert b["critic_gradients"] == c["gradients"] and b["critic_optimizer"] == c["optimizer"]
    assert b["critic_gradients"] < a["critic_gradients"] // 10
    assert {k: v for k, v in b.items() if not k.startswith("critic_")} == \
        {k: v for k, v in a.items() if not k.startswith("critic_")}
