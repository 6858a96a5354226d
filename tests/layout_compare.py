"""One comparison for the layout-equivalence tests: a parallel run against the same groups on one
rank. A run is `(per-group [(loss, log-probs per branch)], full gradients by canonical key, ...)`."""
from __future__ import annotations


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def compare(ref, got) -> dict:
    """Worst relative loss, absolute log-prob and relative gradient difference of `got` against `ref`."""
    (rg, rgrad), (gg, ggrad) = ref[:2], got[:2]
    assert set(ggrad) == set(rgrad), sorted(set(ggrad) ^ set(rgrad))[:4]
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(gg, rg))
    logp = max(abs(x - y) for a, b in zip(gg, rg) for la, lb in zip(a[1], b[1]) for x, y in zip(la, lb))
    grad = max(rel(ggrad[k], rgrad[k]) for k in rgrad)
    return dict(loss=loss, logp=logp, grad=grad)


def check_steps(steps: dict, rank: int, prefix: str = "") -> None:
    """Print (rank 0) and assert every (layout, mode) comparison within 1e-10."""
    for (name, mode), r in steps.items():
        if rank == 0:
            print(f"{prefix}{name} {mode}: loss {r['loss']:.1e}, logp {r['logp']:.1e}, worst grad {r['grad']:.1e}")
        assert r["loss"] <= 1e-10 and r["logp"] <= 1e-10 and r["grad"] <= 1e-10, (name, mode, r)


def replay_groups(model, ddp, par, groups, mode: str, chunk_len: int = 5) -> tuple[list, dict]:
    """The groups through Megatron DDP in `mode` (group i on data-parallel rank i % dp, GRPO beta 0.05,
    capture chunks of `chunk_len`), reduced by finalize_model_grads: (per group (loss, log-probs) on
    every rank, full gradients by canonical key)."""
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from longstraw_mcore.checkpoint.full_state import gather_full
    from longstraw_mcore.config import GRPOConfig, ReplayConfig
    from longstraw_mcore.replay.group_step import process_group

    ddp.zero_grad_buffer()
    mine = {}
    for i, g in enumerate(groups):
        if i % par.dp == par.pgs.dp.rank():
            st = process_group(ddp, g, ReplayConfig(mode=mode, chunk_len=chunk_len), GRPOConfig(beta=0.05),
                               scale=par.dp / len(groups))
            mine[i] = (st.loss, st.logprobs)
    finalize_model_grads([ddp], pg_collection=par.pgs)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {k: v for d in every for k, v in d.items()}
    return [merged[i] for i in range(len(groups))], gather_full(model, grads=True)
