"""The dispatch of `ops.gdn` in an ordinary (compiled-Triton) process on the CPU: `auto` and `plain` run the
twins for the rule and the conv, and `fla` is refused with a message naming the reason (CPU tensors
without Triton's interpreter; float64) instead of silently measuring the twin; the kernel counts the
validate receipt reports. fla's kernels themselves are held to the twins under the interpreter
(tests/unit/test_fla_interpreter.py) and on CUDA by the GPU check."""

from __future__ import annotations

import pytest
import torch


def test_gdn_dispatch_on_cpu():
    from longstraw_mcore.ops import dispatch, gated_delta, triton_interpret

    if triton_interpret.active():
        pytest.skip("this process interprets Triton (TRITON_INTERPRET=1): fla would run on CPU tensors")
    v = torch.randn(1, 3, 2, 16)
    dispatch.reset_kernels()
    assert dispatch.gdn_kernel(v, 16) is gated_delta and dispatch.conv_kernel(v) is gated_delta
    assert dispatch.gdn_kernel(v.bfloat16(), 16) is gated_delta
    with dispatch.override(gdn="fla"), pytest.raises(ValueError, match="ops.gdn=fla cannot run here: values are on "
                                                                         "the CPU and Triton is not interpreting"):
        dispatch.gdn_kernel(v, 16)
    with dispatch.override(gdn="fla"), pytest.raises(ValueError, match="values are torch.float64"):
        dispatch.conv_kernel(v.double())
    with dispatch.override(gdn="plain"):
        assert dispatch.gdn_kernel(v, 16) is gated_delta
    assert dispatch.kernels_run() == {"gdn_conv": {"plain": 1}, "gdn_rule": {"plain": 3}}


def test_kda_dispatch_on_cpu():
    """Kimi Delta Attention's rule under the same `ops.gdn` choice: the twin (ops/kda.py) for auto / plain on the
    CPU, a bound changes nothing there; `fla` refused naming the reason (the CPU without the interpreter,
    float64, a key dim over fla's 256); the counts as op "kda_rule"."""
    from longstraw_mcore.ops import dispatch, fla_kda, kda, triton_interpret

    if triton_interpret.active():
        pytest.skip("this process interprets Triton (TRITON_INTERPRET=1): fla would run on CPU tensors")
    v = torch.randn(1, 3, 2, 16)
    dispatch.reset_kernels()
    assert dispatch.kda_kernel(v) is kda and dispatch.kda_kernel(v.bfloat16(), lower_bound=-5.0) is kda
    with dispatch.override(gdn="plain"):
        assert dispatch.kda_kernel(v, 16) is kda
    with dispatch.override(gdn="fla"):
        with pytest.raises(ValueError, match="ops.gdn=fla cannot run Kimi Delta Attention here: values are on the CPU "
                                             "and Triton is not interpreting"):
            dispatch.kda_kernel(v)
        with pytest.raises(ValueError, match=r"values are torch.float64 \(fla runs bf16 / fp16 / fp32\)"):
            dispatch.kda_kernel(v.double())
        with pytest.raises(ValueError, match=r"key dim 300 > 256 .*\(use ops.gdn=auto or plain\)"):
            dispatch.kda_kernel(v, key_dim=300)
    assert dispatch.kernels_run() == {"kda_rule": {"plain": 3}}
    assert fla_kda.missing(v.half(), 16) == fla_kda.missing(v, 16) and "not interpreting" in fla_kda.missing(v)
    assert fla_kda.missing(torch.zeros(1, 1, 1, 257)).startswith("key dim 257 > 256")
