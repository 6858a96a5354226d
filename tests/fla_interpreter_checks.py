"""flash-linear-attention's kernels (ops/fla_gdn.py) against the plain twins (ops/gated_delta.py), run on
CPU tensors under Triton's interpreter. Run as a script in a fresh process with TRITON_INTERPRET=1 (it
must be set before fla's kernels are decorated); prints one JSON object:

    {"<case>": {"<tensor>": max |fla - twin| / max |twin|, ...}, ..., "dispatch": {...}, "gate": {...}}

Cases (float32, tiny shapes): the rule with grouped values (2 key heads, 4 value heads), an initial state
and a gradient entering through the final state (exact mode's sweep and replay); without an initial
state over two of fla's 64-token chunks with V != K (capture's first chunk); one token (a decode step);
the sequence-parallel piece maps (values K wider, entered with [I | 0]: ops/gdn_pieces.py); the causal
conv with a window in and out, without one, shorter than the window, and empty (a CP piece); and Kimi Delta
Attention's rule (ops/fla_kda.py against ops/kda.py: tests/fla_kda_checks.py, "kda_*"). Every output, state
and input gradient is compared, the state gradients included. tests/unit/test_fla_interpreter.py runs it and
holds every figure to 1e-5.
"""

from __future__ import annotations

import json
import os

import torch

import fla_kda_checks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _compare(fn, inputs: dict, names: list[str], mods=None) -> dict:
    """fn(module, **leaves) -> outputs under fla and the twin (`mods`: (fla's, the twin's), default the Gated
    DeltaNet pair); every output and every input's gradient, with a fixed random weighting of each output as
    the loss (so every entry of each gets a gradient)."""
    from longstraw_mcore.ops import fla_gdn, gated_delta

    res = {}
    for name, mod in zip(("fla", "plain"), mods or (fla_gdn, gated_delta)):
        leaves = {n: (x.clone().requires_grad_(True) if x is not None else None) for n, x in inputs.items()}
        outs = fn(mod, **leaves)
        gen = torch.Generator().manual_seed(7)
        loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
        loss.backward()
        res[name] = list(outs) + [leaves[n].grad if leaves[n].grad is not None else torch.zeros(())
                                  for n in inputs if leaves[n] is not None]
    keys = names + ["d_" + n for n in inputs if inputs[n] is not None]
    return {k: _rel(a.detach(), b.detach()) for k, a, b in zip(keys, res["fla"], res["plain"])}


def _rule_inputs(gen, B, T, h, r, K, V, init: bool) -> dict:
    return dict(q=torch.randn(B, T, h, K, generator=gen), k=torch.randn(B, T, h, K, generator=gen),
                v=torch.randn(B, T, h * r, V, generator=gen), g=-torch.rand(B, T, h * r, generator=gen) * 0.5,
                beta=torch.rand(B, T, h * r, generator=gen),
                s0=torch.randn(B, h * r, K, V, generator=gen) * 0.3 if init else None)


def rule_cases(gen) -> dict:
    def rule(mod, q, k, v, g, beta, s0):
        return mod.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=16)

    out = {}
    for case, shape in (("rule_grouped_state", (2, 37, 2, 2, 16, 16, True)),
                        ("rule_no_state_two_chunks", (1, 70, 1, 3, 16, 32, False)),
                        ("rule_one_token", (2, 1, 2, 2, 16, 16, True))):
        out[case] = _compare(rule, _rule_inputs(gen, *shape), ["o", "final_state"])
    return out


def piece_case(gen) -> dict:
    from longstraw_mcore.ops import dispatch
    from longstraw_mcore.ops.gdn_pieces import piece_maps

    x = _rule_inputs(gen, 1, 21, 2, 2, 16, 16, False)
    del x["s0"]

    def maps(mod, q, k, v, g, beta):
        with dispatch.override(gdn="fla" if mod.__name__.endswith("fla_gdn") else "plain"):
            pm = piece_maps(q, k, v, g, beta, chunk_size=16)
        return pm.c, pm.o0, pm.M, pm.B

    return {"piece_maps": _compare(maps, x, ["c", "o0", "M", "B"])}


def conv_cases(gen) -> dict:
    def conv(mod, x, w, s0):
        return mod.causal_conv1d(x, w, s0, activation="silu")

    out = {}
    for case, (T, init) in (("conv_window", (20, True)), ("conv_no_window", (9, False)),
                            ("conv_shorter_than_window", (2, True))):
        inputs = dict(x=torch.randn(2, T, 24, generator=gen), w=torch.randn(24, 4, generator=gen),
                      s0=torch.randn(2, 24, 3, generator=gen) if init else None)
        out[case] = _compare(conv, inputs, ["y", "window"])
    from longstraw_mcore.ops import fla_gdn

    y, s = fla_gdn.causal_conv1d(torch.randn(1, 0, 24), torch.randn(24, 4), torch.randn(1, 24, 3))
    out["conv_empty"] = {"shape": list(y.shape) + list(s.shape)}
    return out


def dispatch_case() -> dict:
    from longstraw_mcore.ops import dispatch, fla_gdn, gated_delta

    v = torch.randn(1, 3, 2, 16)
    out = {}
    with dispatch.override(gdn="fla"):
        out["fla_forced_cpu_float32"] = dispatch.gdn_kernel(v, 16) is fla_gdn and dispatch.conv_kernel(v) is fla_gdn
        try:
            dispatch.gdn_kernel(v.double(), 16)
            out["fla_float64_error"] = None
        except ValueError as e:
            out["fla_float64_error"] = str(e)
    out["auto_cpu_is_plain"] = dispatch.gdn_kernel(v, 16) is gated_delta
    return out


def gate_case(gen) -> dict:
    """The Hopper #640 gate (ops/fla_gdn.py), with the device test forced true: K <= 64 is refused (by
    `missing` and in the backward), K = 128 runs with fla's flag lifted for the call only."""
    from fla.ops.common import chunk_o

    from longstraw_mcore.ops import fla_gdn

    fla_gdn.prepare()
    real = fla_gdn._hopper_gate_applies
    fla_gdn._hopper_gate_applies = lambda device: True
    flag = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = False
    out = {"missing_k16": fla_gdn.missing(torch.zeros(1), key_dim=16), "missing_k128": fla_gdn.missing(torch.zeros(1),
                                                                                                   key_dim=128)}
    try:
        for K in (16, 128):
            x = {n: t.requires_grad_(True) for n, t in _rule_inputs(gen, 1, 8, 1, 1, K, 16, True).items()}
            o, s = fla_gdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"])
            try:
                (o.sum() + s.sum()).backward()
                out[f"backward_k{K}"] = "ran" if x["k"].grad is not None else "no gradient"
            except RuntimeError as e:
                out[f"backward_k{K}"] = str(e)
            out[f"flag_after_k{K}"] = chunk_o.TRITON_ABOVE_3_7_1
    finally:
        fla_gdn._hopper_gate_applies = real
        chunk_o.TRITON_ABOVE_3_7_1 = flag
    return out


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    out = {}
    out.update(rule_cases(gen))
    out.update(piece_case(gen))
    out.update(conv_cases(gen))
    out["dispatch"] = dispatch_case()
    out["gate"] = gate_case(gen)
    out.update(fla_kda_checks.kda_cases(_compare))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
