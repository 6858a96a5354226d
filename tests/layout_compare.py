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
