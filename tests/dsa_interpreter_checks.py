"""The project's DSA Triton kernels (ops/dsa_triton_indexer.py, ops/dsa_triton_mla.py) against the plain
twins (ops/dsa.py), on CPU tensors under Triton's interpreter. Run by tests/unit/test_dsa_interpreter.py
in a fresh process with TRITON_INTERPRET=1 (set before the kernels are decorated); prints one JSON line:
{case: {what: relative difference or flag}}. Float32 throughout (the interpreter's bf16 is not bf16)."""

from __future__ import annotations

import json
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
torch.set_num_threads(1)

from longstraw_mcore.ops import dispatch, dsa  # noqa: E402
from longstraw_mcore.ops import dsa_triton_indexer as kidx  # noqa: E402
from longstraw_mcore.ops import dsa_triton_mla as kmla  # noqa: E402
from longstraw_mcore.parallel.cp_dsa import merge_proposals  # noqa: E402

NEG = float("-inf")


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)) if a.numel() else 0.0


def indexer_case(B, T, S, HI, DI, k, counted_frac=None, seed=0, zeros=False, block=0):
    """Twin vs kernel: the same rows where valid (and validity), the scores, and -- where the twin's
    selection includes invalid slots (fewer visible keys than k) -- the same rows there too. `block`: the
    kernel's key rows per selection step (0: its default, one step here); the twin's are 5."""
    g = torch.Generator().manual_seed(seed)
    q, key = torch.randn(B, T, HI, DI, generator=g), torch.randn(B, S, DI, generator=g)
    w = torch.randn(B, T, HI, generator=g)
    if zeros:  # ReLU zeros everywhere for half the keys: many exact ties, broken by position
        key[:, ::2] = 0.0
    q_pos = torch.arange(S - T, S) if S >= T else torch.arange(T)
    k_pos = torch.arange(S)
    counted = None if counted_frac is None else torch.rand(S, generator=g) < counted_frac
    r1, v1 = dsa.indexer_topk(q, key, w, q_pos, k_pos, k, 5, counted)
    r2, v2 = kidx.indexer_topk(q, key, w, q_pos, k_pos, k, block, counted)
    ok1, ok2 = v1 > NEG, v2 > NEG
    return {"shape_equal": list(r1.shape) == list(r2.shape), "valid_equal": bool((ok1 == ok2).all()),
            "rows_equal": bool((r1[ok1] == r2[ok1]).all()), "all_rows_equal": bool((r1 == r2).all()),
            "scores": rel(v1[ok1], v2[ok1]), "valid_slots": int(ok1.sum()), "slots": ok1.numel(),
            "ties": int((v1[ok1] == 0).sum())}


def _mla_inputs(B, T, S, H, Dn, Dr, R, k, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    qn, qp, c, pe, wuk = mk(B, T, H, Dn), mk(B, T, H, Dr), mk(B, S, R), mk(B, S, Dr), mk(H, Dn, R) * 0.3
    wuv = mk(H, 7, R) * 0.3
    idx = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
    valid = torch.rand(B, T, k, generator=g) > 0.25
    valid[0, 0] = False  # a query with no valid key here (lse -inf, output 0)
    return qn, qp, c, pe, wuk, wuv, idx, valid, g


def mla_partial_case(B, T, S, H, Dn, Dr, R, k, latent_grad=True, seed=1):
    """mla_sparse_partial forward (o_lat, lse) and backward with upstream gradients into both outputs
    (lse's: as the CP merge gives it); the latents take a gradient or, `latent_grad` False (a detached
    prompt state), none."""
    qn, qp, c, pe, wuk, _, idx, valid, g = _mla_inputs(B, T, S, H, Dn, Dr, R, k, seed)
    go, gl = torch.randn(B, T, H, R, generator=g), torch.randn(B, T, H, generator=g)
    out = {}
    res = []
    for mod in (dsa, kmla):
        ins = [x.clone().requires_grad_(True) for x in (qn, qp, wuk)]
        lat = [x.clone().requires_grad_(latent_grad) for x in (c, pe)]
        o, lse = mod.mla_sparse_partial(ins[0], ins[1], lat[0], lat[1], ins[2], idx, valid, 0.37)
        loss = (o * go).sum() + (torch.where(torch.isinf(lse), 0, lse) * gl).sum()
        grads = torch.autograd.grad(loss, ins + (lat if latent_grad else []))
        res.append((o, lse, grads, [x.grad for x in lat]))
    (o1, l1, g1, _), (o2, l2, g2, lg2) = res
    none = torch.isinf(l1)
    out["o_lat"], out["lse"] = rel(o1, o2), rel(l1[~none], l2[~none])
    out["lse_none_equal"] = bool((none == torch.isinf(l2)).all()) and bool(none.any())
    names = ["d_q_nope", "d_q_pe", "d_w_uk"] + (["d_c_kv", "d_k_pe"] if latent_grad else [])
    out.update({n: rel(a, b) for n, a, b in zip(names, g1, g2)})
    out["detached_state_untouched"] = latent_grad or all(x is None for x in lg2)
    return out


def mla_full_case(B=1, T=6, S=30, H=4, Dn=8, Dr=8, R=16, k=10, seed=2):
    """mla_sparse (one rank: the output through W_UV) forward and every gradient."""
    qn, qp, c, pe, wuk, wuv, idx, valid, g = _mla_inputs(B, T, S, H, Dn, Dr, R, k, seed)
    valid[..., 0] = True  # one rank: a query always sees a key (itself); the twin's softmax needs one
    go = None
    res = []
    for mod in (dsa, kmla):
        ins = [x.clone().requires_grad_(True) for x in (qn, qp, c, pe, wuk, wuv)]
        o = mod.mla_sparse(ins[0], ins[1], ins[2], ins[3], ins[4], ins[5], idx, valid, 0.37)
        go = torch.randn(o.shape, generator=torch.Generator().manual_seed(9)) if go is None else go
        res.append((o, torch.autograd.grad((o * go).sum(), ins)))
    (o1, g1), (o2, g2) = res
    names = ["d_q_nope", "d_q_pe", "d_c_kv", "d_k_pe", "d_w_uk", "d_w_uv"]
    return {"out": rel(o1, o2), **{n: rel(a, b) for n, a, b in zip(names, g1, g2)}}


def cp_pieces_case(T=6, S=48, H=4, Dn=8, Dr=8, R=16, HI=3, DI=16, k=12, seed=3):
    """Context parallelism at CP=2 with the kernels, by hand: the keys in two zig-zag pieces (rank r holds
    the rows it counts), each piece's top-k by the kernel merged by parallel/cp_dsa.merge_proposals (what
    cp_select runs on the all-gathered proposals), then each piece's partial attention over the
    selected rows it holds, merged by log-sum-exp; against the twin's one-rank selection and attention."""
    g = torch.Generator().manual_seed(seed)
    q, key, w = torch.randn(1, T, HI, DI, generator=g), torch.randn(1, S, DI, generator=g), torch.randn(1, T, HI, generator=g)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    quarter = S // 4
    owner = torch.zeros(S, dtype=torch.long)
    owner[quarter:2 * quarter] = owner[2 * quarter:3 * quarter] = 1  # zig-zag: rank 0 first + last quarter
    rows1, vals1 = dsa.indexer_topk(q, key, w, q_pos, k_pos, k, 7)
    props_v, props_p = [], []
    for r in (0, 1):
        rr, vv = kidx.indexer_topk(q, key, w, q_pos, k_pos, k, counted=owner == r)
        props_v.append(vv), props_p.append(k_pos[rr])
    sel, sv = merge_proposals(torch.cat(props_v, -1), torch.cat(props_p, -1), k)
    valid = sv > NEG
    out = {"selection_equal": bool((sel[valid] == k_pos[rows1][vals1 > NEG]).all())
           and bool((valid == (vals1 > NEG)).all())}
    qn, qp, c, pe = (torch.randn(*s, generator=g) for s in ((1, T, H, Dn), (1, T, H, Dr), (1, S, R), (1, S, Dr)))
    wuk = torch.randn(H, Dn, R, generator=g) * 0.3
    res = []
    for parts in ("twin", "kernel"):
        ins = [x.clone().requires_grad_(True) for x in (qn, qp, c, pe, wuk)]
        if parts == "twin":
            o, _ = dsa.mla_sparse_partial(ins[0], ins[1], ins[2], ins[3], ins[4], sel, valid, 0.37)
        else:
            os_, ls = [], []
            for r in (0, 1):
                mine = valid & (owner[sel] == r)
                o_r, l_r = kmla.mla_sparse_partial(ins[0], ins[1], ins[2], ins[3], ins[4], sel, mine, 0.37)
                os_.append(o_r), ls.append(l_r)
            m = torch.maximum(ls[0], ls[1])
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            wts = [torch.exp(x - m) for x in ls]
            o = (wts[0][..., None] * os_[0] + wts[1][..., None] * os_[1]) / (wts[0] + wts[1]).clamp_min(1e-30)[..., None]
        go = torch.randn(o.shape, generator=torch.Generator().manual_seed(4))
        res.append((o, torch.autograd.grad((o * go).sum(), ins)))
    (o1, g1), (o2, g2) = res
    out["out"] = rel(o1, o2)
    out.update({n: rel(a, b) for n, a, b in zip(["d_q_nope", "d_q_pe", "d_c_kv", "d_k_pe", "d_w_uk"], g1, g2)})
    return out


def indexer_parts_case(B=2, T=9, S0=40, S1=9, HI=2, DI=16, k=8, seed=5):
    """Keys in two parts as the prompt state hands them over (its rows, batch 1; the call's own, batch B):
    the kernel reads them in place; the twin joins them."""
    g = torch.Generator().manual_seed(seed)
    q, w = torch.randn(B, T, HI, DI, generator=g), torch.randn(B, T, HI, generator=g)
    head, tail = torch.randn(1, S0, DI, generator=g), torch.randn(B, S1, DI, generator=g)
    q_pos, k_pos = torch.arange(S0, S0 + T), torch.arange(S0 + S1)
    r1, v1 = dsa.indexer_topk(q, dsa.joined_rows((head, tail)), w, q_pos, k_pos, k, 16)
    r2, v2 = kidx.indexer_topk(q, (head, tail), w, q_pos, k_pos, k, 30)  # a step across the parts
    ok = v1 > NEG
    return {"rows_equal": bool((r1 == r2).all()), "valid_equal": bool((ok == (v2 > NEG)).all()),
            "scores": rel(v1[ok], v2[ok]), "tail_chosen": int((r1[ok] >= S0).sum())}


def mla_parts_case(state_grad: bool, B=2, T=4, S0=30, S1=4, H=4, Dn=8, Dr=8, R=16, k=10, seed=6):
    """Sparse MLA over latents in two parts (the state's rows, batch 1; the call's own, batch B): the kernel
    reads them in place and gives each part a gradient of its own shape; the twin joins them. `state_grad`:
    the state's rows take a gradient (exact mode's leaves) or none (detached)."""
    g = torch.Generator().manual_seed(seed)
    qn, qp = torch.randn(B, T, H, Dn, generator=g), torch.randn(B, T, H, Dr, generator=g)
    c0, pe0 = torch.randn(1, S0, R, generator=g), torch.randn(1, S0, Dr, generator=g)
    c1, pe1 = torch.randn(B, S1, R, generator=g), torch.randn(B, S1, Dr, generator=g)
    wuk = torch.randn(H, Dn, R, generator=g) * 0.3
    S = S0 + S1
    idx = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
    idx[..., 0] = S0  # every query reads an own row
    valid = torch.rand(B, T, k, generator=g) > 0.2
    go, gl = torch.randn(B, T, H, R, generator=g), torch.randn(B, T, H, generator=g)
    res = []
    for mod in (dsa, kmla):
        ins = [x.clone().requires_grad_(True) for x in (qn, qp, wuk, c1, pe1)]
        state = [x.clone().requires_grad_(state_grad) for x in (c0, pe0)]
        c, pe = (state[0], ins[3]), (state[1], ins[4])
        o, lse = mod.mla_sparse_partial(ins[0], ins[1], c, pe, ins[2], idx, valid, 0.37)
        loss = (o * go).sum() + (torch.where(torch.isinf(lse), 0, lse) * gl).sum()
        grads = torch.autograd.grad(loss, ins + (state if state_grad else []))
        res.append((o, lse, grads))
    (o1, l1, g1), (o2, l2, g2) = res
    names = ["d_q_nope", "d_q_pe", "d_w_uk", "d_own_c", "d_own_pe"] + (["d_state_c", "d_state_pe"] if state_grad else [])
    out = {"o_lat": rel(o1, o2), "lse": rel(l1[~torch.isinf(l1)], l2[~torch.isinf(l2)])}
    out.update({n: rel(a, b) for n, a, b in zip(names, g1, g2)})
    out["shapes_equal"] = all(a.shape == b.shape for a, b in zip(g1, g2))
    return out


def dispatch_case():
    x32, x64 = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    out = {}
    with dispatch.override(dsa="triton"):
        out["triton_forced_cpu_float32"] = dispatch.dsa_kernel(x32, "dsa_indexer") is kidx
        try:
            dispatch.dsa_kernel(x64, "dsa_attention")
            out["triton_float64_error"] = None
        except ValueError as e:
            out["triton_float64_error"] = str(e)
    with dispatch.override(dsa="auto"):
        out["auto_cpu_is_plain"] = dispatch.dsa_kernel(x32, "dsa_attention") is dsa
    return out


def main():
    checks = {
        "indexer_dense": indexer_case(1, 20, 20, 2, 16, 32),            # k above the keys: every key chosen
        "indexer_sparse": indexer_case(2, 20, 70, 3, 24, 8, block=23),  # top-k well below the keys, 4 steps
        "indexer_ties": indexer_case(1, 18, 40, 2, 16, 16, zeros=True),  # exact-zero scores, broken by position
        "indexer_counted": indexer_case(1, 17, 50, 2, 16, 8, counted_frac=0.5, block=9),  # a CP rank's rows
        "mla_partial_exact": mla_partial_case(2, 5, 40, 20, 16, 8, 24, 20),  # 2 head blocks, R padded
        "mla_partial_detached": mla_partial_case(1, 4, 30, 3, 8, 8, 16, 8, latent_grad=False),
        "mla_partial_dense": mla_partial_case(1, 6, 6, 4, 8, 8, 16, 6),     # k = every key
        "mla_full": mla_full_case(),
        "indexer_parts": indexer_parts_case(),
        "mla_parts_detached": mla_parts_case(False),
        "mla_parts_exact": mla_parts_case(True),
        "cp2_pieces": cp_pieces_case(),
        "dispatch": dispatch_case(),
    }
    print(json.dumps(checks))


if __name__ == "__main__":
    main()
