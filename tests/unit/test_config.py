"""Typed configs: YAML + key=value overrides, and errors that name the value and what is valid."""

from __future__ import annotations

import pytest

from longstraw_mcore.config import ConfigError, ParallelConfig, load_config

TINY = "configs/qwen3.6-tiny.yaml"


def test_yaml_and_overrides():
    cfg = load_config(TINY, ["parallel.tp=2", "model.dtype=float64", "device=cpu"])
    assert (cfg.parallel.tp, cfg.model.dtype, cfg.device) == (2, "float64", "cpu")
    assert cfg.model.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]


def test_real_27b_dimensions():
    m = load_config("configs/qwen3.6-27b.yaml").model
    assert (m.num_layers, m.hidden_size, m.intermediate_size, m.vocab_size) == (64, 5120, 17408, 248320)
    full = [i for i, t in enumerate(m.layer_types) if t == "full_attention"]
    assert full == list(range(3, 64, 4)) and len(full) == 16
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.rotary_dim) == (24, 4, 256, 64)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim) == (16, 48, 128)


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.tp=3"], "model.num_attention_heads=4 is not divisible by parallel.tp=3"),
    (["model.bogus=1"], "unknown config key(s) ['model.bogus']"),
    (["trainer.lr=1"], "unknown config key(s) ['trainer']"),
    (["model.dtype=float8"], "model.dtype='float8': must be one of ['float32', 'float64', 'bfloat16', 'float16']"),
    (["model.num_key_value_heads=3"], "model.num_attention_heads=4 is not a multiple of model.num_key_value_heads=3"),
    (["parallel.tp=0"], "parallel.tp=0: must be a positive integer"),
    (["device=tpu"], "device='tpu': must be one of"),
    (["parallel.tp"], "expected key=value"),
    # the memory switches that cannot apply (config/memory.py)
    (["memory.state_offload=true"], "memory.state_offload=true needs memory.recompute=layer (got 'none')"),
    (["memory.state_dtype=fp8"], "memory.state_dtype=fp8 needs memory.recompute=layer"),
    (["memory.recompute=layer", "memory.state_dtype=fp8", "model.dtype=float64"],
     "memory.state_dtype=fp8 with model.dtype=float64"),
    (["memory.recompute=layer", "memory.state_dtype=fp8", "replay.mode=exact"],
     "memory.state_dtype=fp8 with replay.mode=exact"),
    (["memory.optimizer_offload=true", "train.grad_reduction=step", "device=cpu"],
     "HybridDeviceOptimizer, which offloads CUDA parameters only"),
    (["memory.grad_offload=true"], "memory.grad_offload with train.grad_reduction='step': Megatron DDP keeps a "
     "full-size gradient buffer"),
    (["memory.grad_offload=2"], "memory.grad_offload=2: expected bool"),
    (["train.grad_bucket_mib=-1"], "train.grad_bucket_mib=-1.0: must be a number > 0"),
    (["memory.recompute=all"], "memory.recompute='all': must be one of ['none', 'layer']"),
    (["memory.mla_query_block=-1"], "memory.mla_query_block=-1: must be an integer >= 0"),
    # replay.batch_branches is gone, without an alias: either value names its replacement
    (["replay.batch_branches=true"], "config key replay.batch_branches was removed; use replay.batch_tokens"),
    (["replay.batch_branches=false"], "replay.batch_tokens=0 is batch_branches=false"),
    (["replay.batch_tokens=-1"], "replay.batch_tokens=-1: must be an integer >= 0"),
    (["replay.batch_tokens=true"], "replay.batch_tokens=True: must be an integer >= 0"),
])
def test_bad_config_errors_name_the_value(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert needle in str(e.value), str(e.value)


def test_missing_required_key_and_missing_file():
    with pytest.raises(ConfigError, match=r"missing required config key\(s\): \['model.hidden_size'\]"):
        load_config(None, [], base={"model": {"vocab_size": 8, "intermediate_size": 8, "num_layers": 1,
                                              "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 4,
                                              "linear_num_key_heads": 1, "linear_num_value_heads": 1,
                                              "linear_key_head_dim": 4, "linear_value_head_dim": 4}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_world_size_must_match_layout():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        ParallelConfig(tp=4).dp_for(6)
    assert ParallelConfig(tp=2, pp=2).dp_for(8) == 2


def test_float16_describes_checkpoints_but_runs_refuse_it():
    """A float16 checkpoint's config loads (conversion keeps its dtype); every subcommand refuses to
    run in float16 (no loss scaling) and says how to cast it."""
    from longstraw_mcore.commands.preflight import check_run

    cfg = load_config(TINY, ["model.dtype=float16"])
    for cmd in ("train", "validate", "smoke"):
        with pytest.raises(ConfigError, match="pass model.dtype=bfloat16 to cast float16 weights on load"):
            check_run(cfg, cmd, None)
    check_run(load_config(TINY, ["model.dtype=bfloat16"]), "train", None)
