"""memory/grad_stage.py against autograd's own `.grad` accumulation (CPU, float64 and bfloat16).

Two backward passes into the same parameters within one micro-step (as a prefix tree's reentrant
segment backward makes): the host buffer must equal what `.grad` would hold after both, bit for bit,
because the reduction reads it in place of `.grad`. A parameter no backward reached reports None (the
reduction sends zeros for it, as it does for a `.grad` that is None), and after `clear()` the next
micro-step starts from nothing."""

from __future__ import annotations

import torch

from longstraw_mcore.memory.grad_stage import HostGradStage


def _net(dtype):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    unused = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    return net, unused


def _two_backwards(net, x):
    net(x[:2]).pow(2).sum().backward()
    net(x[2:]).sin().sum().backward()


def test_host_stage_equals_autograd_accumulation_bitwise():
    for dtype in (torch.float64, torch.bfloat16):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        ref, _ = _net(dtype)
        _two_backwards(ref, x)
        net, unused = _net(dtype)
        params = [*net.parameters(), unused]
        stage = HostGradStage(params, torch.device("cpu"))
        _two_backwards(net, x)
        assert all(p.grad is None for p in params), "a .grad survived its hook"
        stage.ready()
        for p, q in zip(net.parameters(), ref.parameters()):
            got = stage.take(p)
            assert got is not None and got.dtype == dtype and torch.equal(got, q.grad), (dtype, p.shape)
        assert stage.take(unused) is None
        assert stage.nbytes() == sum(p.numel() * p.element_size() for p in params)
        stage.clear()
        net(x[:1]).sum().backward()  # the next micro-step starts from zero, not from the last one's values
        ref.zero_grad(set_to_none=True)
        ref(x[:1]).sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            assert torch.equal(stage.take(p), q.grad), (dtype, p.shape)
        stage.remove()
        net(x[:1]).sum().backward()
        assert all(p.grad is not None for p in net.parameters())  # hooks removed: autograd's .grad again
