"""Every collective of the library reduces tensors on the run's device, by construction.

On CUDA, NCCL takes CUDA tensors only: a scalar accumulator created without naming the device (CPU)
crashed `validate` (grad_norm), `smoke` and the Slurm template (count_parameters), the trainer's
metrics and smoke's loss at dp > 1. On this CPU machine the same defect is made visible by setting
the *default* device to `meta` while our code runs: whatever it creates without naming the run's
device lands on meta and the gloo collective (or the arithmetic with real tensors) fails. Megatron's
own calls (finalize_model_grads, the optimizer step) are run with the default device restored: they
are not ours, and allocate their CPU fallbacks without a device by design.

Four gloo ranks, tp=2 x dp=2, so tensor-parallel and data-parallel reductions both really run. The
results under `meta` must equal those of a normal run (same step, same numbers). A control shows the
harness bites: the old accumulator pattern fails under it."""

from __future__ import annotations

import torch

from longstraw_mcore.launch_local import run_ranks


def _worker(rank, world_size):
    import torch.distributed as dist
    from megatron.core import distributed as mdist
    from hf_reference import tiny_model_config

    from longstraw_mcore.config import ParallelConfig, ReplayConfig, RunConfig, TrainConfig
    from longstraw_mcore.data.rollouts import RolloutGroup
    from longstraw_mcore.families.qwen3_5 import build_model
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.parallel.reduce import all_reduce_max, all_reduce_sum, count_parameters, grad_norm
    from longstraw_mcore.train import trainer as trainer_mod
    from longstraw_mcore.train.trainer import Trainer, build_optimizer, wrap_ddp

    m = tiny_model_config(dtype="float32")
    cfg = RunConfig(model=m, parallel=ParallelConfig(tp=2), device="cpu",
                    replay=ReplayConfig(mode="exact", chunk_len=5), train=TrainConfig(lr=1e-3, groups_per_step=2))
    par = setup_parallel(cfg)
    g = torch.Generator().manual_seed(11)
    groups = [RolloutGroup(prompt=torch.randint(0, m.vocab_size, (13,), generator=g).tolist(),
                           responses=[torch.randint(0, m.vocab_size, (n,), generator=g).tolist() for n in (4, 2)],
                           rewards=[float(i % 2), float((i + 1) % 3)]) for i in range(8)]

    def run(meta: bool):
        torch.manual_seed(cfg.seed)
        model = build_model(m, par, "cpu")
        ddp = wrap_ddp(model, cfg, par)
        opt = build_optimizer(ddp, cfg, par)
        tr = Trainer(cfg, par, ddp, opt, groups)
        real_step, real_finalize = opt.step, mdist.finalize_model_grads

        def shielded(fn):
            def call(*a, **k):
                with torch.device("cpu"):
                    return fn(*a, **k)
            return call

        opt.step, mdist.finalize_model_grads = shielded(real_step), shielded(real_finalize)
        try:
            ctx = torch.device("meta") if meta else torch.device("cpu")
            with ctx:
                metrics = tr.run_step()
                out = dict(n=count_parameters(model, par), gn=grad_norm(model, par),
                           sums=all_reduce_sum([rank, 1.5], par.pgs.dp, par.device),
                           maxes=all_reduce_max([rank], dist.group.WORLD, par.device))
        finally:
            opt.step, mdist.finalize_model_grads = real_step, real_finalize
        out["metrics"] = {k: v for k, v in metrics.items() if k not in ("seconds", "peak_bytes")}
        return out

    plain, meta = run(False), run(True)
    control = None
    try:
        with torch.device("meta"):
            acc = torch.zeros(1, dtype=torch.float64)  # the old pattern: no device named
            dist.all_reduce(acc, group=par.pgs.dp)
            acc.item()
    except Exception as e:  # noqa: BLE001
        control = type(e).__name__
    return plain, meta, control


def test_reductions_run_on_the_run_device():
    for plain, meta, control in run_ranks(_worker, 4, timeout_s=600):
        assert plain == meta, (plain, meta)
        assert plain["metrics"]["groups"] == 4 and plain["maxes"] == [3.0] and plain["sums"][1] == 3.0
        assert plain["gn"] > 0 and plain["n"] > 0
        assert control is not None, "the meta default device did not catch a device-less accumulator"
