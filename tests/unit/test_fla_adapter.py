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
