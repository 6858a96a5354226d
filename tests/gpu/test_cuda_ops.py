"""The ops on a CUDA device equal the same ops on the CPU (float64, <= 1e-12): the attention entry
point with several key sets and state-gradient sinks, the chunked gated delta rule with states, the
causal conv and the vocab-parallel log-probs with padding. Skipped without a GPU; run by
scripts/gpu_check.sh. These are the plain-torch twins; the fast kernels of the GPU issue get their
own comparisons against these."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


def _rel(a, b):
    return float((a.cpu() - b.cpu()).abs().max() / b.abs().max().clamp_min(1e-300))


def test_attention_with_sinks_cuda_equals_cpu():
    from longstraw_mcore.ops.attention import KeySet, attention

    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(*s, generator=g, dtype=F64) for n, s in
            dict(q=(2, 9, 4, 16), kb=(2, 9, 2, 16), vb=(2, 9, 2, 16), kp=(1, 40, 2, 16), vp=(1, 40, 2, 16)).items()}
    res = {}
    for dev in ("cpu", "cuda"):
        t = {n: x.to(dev, copy=True).requires_grad_(n in ("q", "kb", "vb")) for n, x in base.items()}
        sink = (torch.zeros(1, 40, 2, 16, dtype=F64, device=dev), torch.zeros(1, 40, 2, 16, dtype=F64, device=dev))
        out, lse = attention(t["q"], [KeySet(t["kp"], t["vp"], 0, grad=sink), KeySet(t["kb"], t["vb"], 40)], 40,
                             block=8)
        (out.sum() + lse.sum()).backward()
        res[dev] = [out, lse, t["q"].grad, t["kb"].grad, t["vb"].grad, *sink]
    for a, b in zip(res["cuda"], res["cpu"]):
        assert a.device.type == "cuda" and _rel(a, b) <= 1e-12


def test_gated_delta_conv_logprobs_cuda_equal_cpu():
    from longstraw_mcore.loss.logprobs import vocab_parallel_logprobs
    from longstraw_mcore.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 37, 2, 8, generator=g, dtype=F64), torch.randn(1, 37, 2, 8, generator=g, dtype=F64)
    v = torch.randn(1, 37, 4, 8, generator=g, dtype=F64)
    gate = -torch.rand(1, 37, 4, generator=g, dtype=F64)
    beta = torch.rand(1, 37, 4, generator=g, dtype=F64)
    s0 = torch.randn(1, 4, 8, 8, generator=g, dtype=F64)
    x, w = torch.randn(1, 37, 12, generator=g, dtype=F64), torch.randn(12, 4, generator=g, dtype=F64)
    logits, tgt = torch.randn(5, 3, 13, generator=g, dtype=F64), torch.randint(0, 11, (5, 3), generator=g)
    outs = {}
    for dev in ("cpu", "cuda"):
        o, s = chunk_gated_delta_rule(*(t.to(dev) for t in (q, k, v, gate, beta, s0)), chunk_size=8,
                                      state_dtype=F64)
        y, cs = causal_conv1d(x.to(dev), w.to(dev))
        lp = vocab_parallel_logprobs(logits.to(dev), tgt.to(dev), None, vocab_size=11)
        outs[dev] = [o, s, y, cs, lp]
    for a, b in zip(outs["cuda"], outs["cpu"]):
        assert a.device.type == "cuda" and _rel(a, b) <= 1e-12
