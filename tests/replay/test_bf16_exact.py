"""Exact mode in bfloat16 stays close to float64: the state gradient accumulates in float32 over
branches and chunks, so the only differences left are bf16 rounding of weights and activations.

The tiny model (perturbed `transformers` weights) runs one GRPO group (G=4, P=48, capture chunks of
16) in exact mode through Megatron DDP (gradients reduced in float32, as a real bf16 run), once in
float64 and once in bfloat16; the cosine between the two full gradients must be >= 0.999. For
scale, the cosine between detached and exact gradients (both float64) is printed: the bf16 error must
be far smaller than the truncation the detached mode makes."""

from __future__ import annotations

from longstraw_mcore.launch_local import run_ranks


def _grads(dtype, mode, group, full64):
    from hf_reference import tiny_model_config
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.checkpoint.full_state import gather_full, load_full
    from longstraw_mcore.config import GRPOConfig, ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.replay.group_step import process_group
    from longstraw_mcore.train.trainer import wrap_ddp

    m = tiny_model_config(dtype=dtype)
    cfg = RunConfig(model=m, parallel=ParallelConfig(), device="cpu", train=TrainConfig())
    par = setup_parallel(cfg)
    model = build_model(m, par, "cpu")
    load_full(model, full64)
    ddp = wrap_ddp(model, cfg, par)
    ddp.zero_grad_buffer()
    process_group(ddp, group, ReplayConfig(mode=mode, chunk_len=16), GRPOConfig())
    finalize_model_grads([ddp], pg_collection=par.pgs)
    return {k: v.double() for k, v in gather_full(model, grads=True).items()}


def _cos(a, b):
    dot = sum(float((a[k] * b[k]).sum()) for k in a)
    return dot / (sum(float((a[k] ** 2).sum()) for k in a) * sum(float((b[k] ** 2).sum()) for k in a)) ** 0.5


def _worker(rank, world_size):
    from hf_reference import build_hf_model, hf_state, tiny_model_config
    from test_replay_equivalence import make_group

    from longstraw_mcore.checkpoint.qwen3_5 import hf_to_mcore

    m = tiny_model_config()
    full = hf_to_mcore(hf_state(build_hf_model(m, seed=17)), m)
    group = make_group(m, 48, [7, 5, 9, 6], seed=23)
    group.old_logprobs, group.ref_logprobs = None, None  # on-policy GRPO
    e64, e16 = _grads("float64", "exact", group, full), _grads("bfloat16", "exact", group, full)
    d64 = _grads("float64", "detached", group, full)
    return dict(bf16_vs_f64=_cos(e16, e64), detached_vs_exact=_cos(d64, e64),
                worst=min((_cos({k: e16[k]}, {k: e64[k]}), k) for k in e64 if float(e64[k].abs().max()) > 0))


def test_exact_bf16_gradient_cosine_to_float64():
    r = run_ranks(_worker, 1, timeout_s=600)[0]
    print(f"exact mode, bf16 vs float64: gradient cosine {r['bf16_vs_f64']:.6f} (lowest single tensor "
          f"{r['worst'][0]:.4f}: {r['worst'][1]}); detached vs exact (float64): {r['detached_vs_exact']:.4f}")
    assert r["bf16_vs_f64"] >= 0.999
    assert 1 - r["bf16_vs_f64"] < 0.1 * (1 - r["detached_vs_exact"])
