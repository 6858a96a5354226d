"""Kimi Delta Attention through flash-linear-attention (ops/fla_kda.py) against the plain twin (ops/kda.py),
on CPU tensors under Triton's interpreter: the KDA part of tests/fla_interpreter_checks.py (same process,
same `_compare`: every output, the final state and every input's gradient, the initial state's included,
as max |fla - twin| / max |twin|). Float32; shapes tiny (the interpreter runs every program in Python).

Cases ("kda_*"); g is made by the layer's own gate (`kda_gate`) from random projections and then held fixed:
    rule_state        an initial state, an unbounded gate (-e^{A_log} softplus), B=2 over two of fla's
                      64-token chunks (the second partial): exact mode's sweep and replay
    rule_no_state     no initial state, V != K (capture's first chunk)
    carried           40 tokens from an initial state, then 1 token (a decode step) from the state they
                      leave: the gradient of the second reaches the first through fla's dht and dh0
    bounded_strong    GLM-5.3-Flash's bounded gate (lower -5) at its initial decay rates (e^{A_log} in
                      [1, 16], dt_bias 1: most steps decay by e^-4 to e^-5), fla's bounded-gate path
                      (`kda_kernel(v, lower_bound=-5)`, safe_gate) and its general path
    piece_maps        the sequence-parallel piece maps (ops/gdn_pieces.py with the KDA rule: values K + V
                      wide, entered with [I | 0]) as the layer asks for them
Plus `kda_dispatch`: what `kda_kernel` answers under the interpreter (fla forced, bounded, float64 and K > 256
refused naming the value, auto keeps the twin on CPU, the kernel counts) and the empty sequence.
"""

from __future__ import annotations

import torch


def _gate(gen, B, T, H, K, lower_bound, rates=(1.0, 16.0), bias=1.0, spread=1.0):
    """g [B,T,H,K] from the layer's gate: f ~ N(0, spread), A_log = log U(rates), dt_bias = `bias`."""
    from longstraw_mcore.ops.kda import kda_gate

    f = torch.randn(B, T, H * K, generator=gen) * spread
    A_log = (torch.rand(H, generator=gen) * (rates[1] - rates[0]) + rates[0]).log()
    return kda_gate(f, A_log, torch.full((H * K,), bias), lower_bound)


def _inputs(gen, B, T, H, K, V, init: bool, lower_bound=None, **gate) -> dict:
    return dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
                v=torch.randn(B, T, H, V, generator=gen), g=_gate(gen, B, T, H, K, lower_bound, **gate),
                beta=torch.rand(B, T, H, generator=gen),
                s0=torch.randn(B, H, K, V, generator=gen) * 0.3 if init else None)


def _mods():
    from longstraw_mcore.ops import fla_kda, kda

    return fla_kda, kda


def rule_cases(gen, compare) -> dict:
    def rule(mod, q, k, v, g, beta, s0):
        return mod.chunk_kda(q, k, v, g, beta, s0, chunk_size=16)

    out = {}
    # the general gate: rates and a bias that give a mean decay of about e^-0.5 per step
    for case, shape in (("kda_rule_state", (2, 70, 1, 16, 16, True)), ("kda_rule_no_state", (1, 40, 2, 16, 32, False))):
        x = _inputs(gen, *shape, rates=(0.2, 0.6), bias=0.0)
        out[case] = compare(rule, x, ["o", "final_state"], _mods())
    return out


def carried_case(gen, compare) -> dict:
    x = _inputs(gen, 1, 41, 2, 16, 16, True, rates=(0.2, 0.6), bias=0.0)

    def carried(mod, q, k, v, g, beta, s0):
        o1, s1 = mod.chunk_kda(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], s0, chunk_size=16)
        o2, s2 = mod.chunk_kda(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], s1, chunk_size=16)
        return o1, o2, s2

    return {"kda_carried": compare(carried, x, ["o_first", "o_step", "final_state"], _mods())}


def bounded_cases(gen, compare) -> dict:
    from longstraw_mcore.ops import dispatch, fla_kda, kda

    x = _inputs(gen, 1, 70, 2, 16, 16, True, lower_bound=-5.0)
    with dispatch.override(gdn="fla"):
        bounded = dispatch.kda_kernel(x["v"], lower_bound=-5.0)  # the layer's call with its bound: safe_gate

    def rule(mod, q, k, v, g, beta, s0):
        return mod.chunk_kda(q, k, v, g, beta, s0, chunk_size=16)

    out = {"kda_bounded_strong": compare(rule, x, ["o", "final_state"], (bounded, kda)),
           "kda_bounded_strong_general": compare(rule, x, ["o", "final_state"], (fla_kda, kda))}
    out["kda_gate_range"] = [float(x["g"].min()), float(x["g"].mean()), float(x["g"].max())]
    return out


def piece_case(gen, compare) -> dict:
    from longstraw_mcore.ops import dispatch
    from longstraw_mcore.ops.gdn_pieces import piece_maps

    x = _inputs(gen, 1, 30, 2, 16, 16, False, rates=(0.05, 0.2), bias=0.0)  # M = the product of 30 decays
    del x["s0"]

    def maps(mod, q, k, v, g, beta):
        with dispatch.override(gdn="fla" if mod.__name__.endswith("fla_kda") else "plain"):
            rule = dispatch.kda_kernel(v).chunk_kda  # (as models/mixers/kda.py asks)
            pm = piece_maps(q, k, v, g, beta, chunk_size=16, rule=rule)
        return pm.c, pm.o0, pm.M, pm.B

    return {"kda_piece_maps": compare(maps, x, ["c", "o0", "M", "B"], _mods())}


def dispatch_case() -> dict:
    from longstraw_mcore.ops import dispatch, fla_kda, kda

    v = torch.randn(1, 3, 2, 16)
    out = {}
    dispatch.reset_kernels()
    with dispatch.override(gdn="fla"):
        out["fla_forced_cpu_float32"] = dispatch.kda_kernel(v) is fla_kda
        b = dispatch.kda_kernel(v, lower_bound=-5)
        out["bounded"] = [b.chunk_kda.func is fla_kda.chunk_kda, b.chunk_kda.keywords]
        for name, args in (("float64", (v.double(),)), ("key_dim_300", (v, 300))):
            try:
                dispatch.kda_kernel(*args)
                out[f"error_{name}"] = None
            except ValueError as e:
                out[f"error_{name}"] = str(e)
    out["auto_cpu_is_plain"] = dispatch.kda_kernel(v) is kda and dispatch.kda_kernel(v, lower_bound=-5.0) is kda
    out["kernels"] = dispatch.kernels_run()
    s0 = torch.randn(1, 2, 16, 8)
    o, s = fla_kda.chunk_kda(torch.randn(1, 0, 2, 16), torch.randn(1, 0, 2, 16), torch.randn(1, 0, 2, 8),
                             -torch.rand(1, 0, 2, 16), torch.rand(1, 0, 2), s0)
    out["empty"] = {"shape": list(o.shape) + list(s.shape), "state_kept": bool(torch.equal(s, s0))}
    return out


def kda_cases(compare) -> dict:
    """Every KDA case above, in one process (tests/fla_interpreter_checks.py's `main`)."""
    gen = torch.Generator().manual_seed(11)
    out = {}
    out.update(rule_cases(gen, compare))
    out.update(carried_case(gen, compare))
    out.update(bounded_cases(gen, compare))
    out.update(piece_case(gen, compare))
    out["kda_dispatch"] = dispatch_case()
    return out
