"""memory.grad_offload: gradients leave the device as autograd completes them.

Without it a micro-step (one backward: a branch, a branch batch, an exact-mode chunk) ends with every
trainable parameter's `.grad` on the device in the model dtype, a full-size gradient, until
train/zero2.py reduce-scatters it. With it, a hook on each parameter (`register_post_accumulate_grad_hook`,
run once per backward after autograd has summed every contribution to that parameter) copies the
gradient into the parameter's host buffer and frees the `.grad`. The device then holds at most the
gradients autograd is still producing (one node's: autograd runs a parameter's AccumulateGrad as soon as
it is ready), and the reduce-scatter brings the host copies back one bucket at a time.

Values: the host buffer is in the parameter's dtype, the same values `.grad` would hold; a second
backward into the same parameter within one micro-step (a prefix tree's reentrant segment backward) is
added on the host in that dtype, as autograd adds into `.grad`. So the reduction sees bit-identical
gradients (tests/replay/test_grad_offload.py).

CUDA: the buffers are pinned and the copy is asynchronous on the backward's stream; the freed `.grad`
block is reused only by later work on that stream, after the copy. `ready()` synchronizes before the
host buffers are read. The copies share the backward's stream (no side stream: not measured on a GPU yet).
"""

from __future__ import annotations

import torch


class HostGradStage:
    """Host buffers for `params`' gradients of the current micro-step, filled by autograd hooks."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.host = {p: torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for p in params}
        self.filled: set = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._stage) for p in params]

    def _stage(self, p: torch.nn.Parameter) -> None:
        g = p.grad
        assert g is not None and g.shape == p.shape and g.dtype == p.dtype, (p.shape, None if g is None else g.shape)
        buf = self.host[p]
        if p in self.filled:  # a second backward into p within this micro-step: add as autograd would
            self._sync()
            buf.add_(g.detach().to("cpu"))
        else:
            buf.copy_(g.detach(), non_blocking=True)
            self.filled.add(p)
        p.grad = None  # the device copy is gone; the host buffer holds this micro-step's gradient

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def ready(self) -> None:
        """Wait for the copies in flight (CUDA): call before `take`."""
        self._sync()

    def take(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """p's gradient of this micro-step (host), or None when no backward reached it."""
        return self.host[p] if p in self.filled else None

    def clear(self) -> None:
        """The micro-step's gradients are reduced: the buffers are free for the next one."""
        self.filled.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.host.values())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
