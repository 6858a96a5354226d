"""Megatron-Core 0.19.2's shape exchange between pipeline stages, made safe where a stage's previous and next
stage are one rank (a pipeline of 2) and both directions are exchanged in one call (its interleaved schedule).

With `variable_seq_lengths` every transfer between stages is preceded by an exchange of shapes
(`P2PCommunicator._communicate_shapes`). Megatron enqueues its point-to-point ops as [send to prev, receive
from prev, send to next, receive from next]. Messages between two ranks pair in the order they were enqueued,
and at pp = 2 "prev" and "next" are the same peer, which holds the opposite roles: its first receive, the
shape of what its prev sends forward, meets this rank's first send, the shape of a gradient going back.
The shapes cross, the received tensors are sized wrongly, and the schedule fails in backward with a shape
mismatch; with equal lengths the values cross silently. Measured here on gloo: PP=2 x VPP=2 with variable
lengths failed, PP=4 x VPP=2 equalled one rank (tests/dist/test_vpp_schedule.py). Upstream: Megatron-LM
issue 5100, pull request 5271; 0.19.2, the newest release on PyPI (2026-12), does not have the fix.

`install()` replaces the exchange, once per process, for communicators whose previous and next rank are the
same: the sends go next then previous, the receives previous then next, so that each side's n-th send to the
other meets the other's n-th receive from it in the role it was meant for. Elsewhere Megatron's own runs.
The tensors themselves cross the same way through Megatron's batched p2p (`batch_p2p_comm`); its unbatched
path orders them by rank parity and is right, so the model chunks' config turns batching off
(models/language_model.py pipeline_kwargs), as Megatron runs its interleaved schedule with overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MARK = "_longstraw_same_peer_shapes"


def _shape_device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def install() -> None:
    """Make P2PCommunicator's shape exchange pair correctly when previous and next rank are one."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    if getattr(P2PCommunicator, _MARK, False):
        return
    megatron_shapes = P2PCommunicator._communicate_shapes

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.next_rank != self.prev_rank or self.config.use_ring_exchange_p2p:
            return megatron_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        dev = _shape_device(self.pp_group)
        sent = {k: torch.tensor(t.size(), device=dev, dtype=torch.int64)
                for k, t in (("next", tensor_send_next), ("prev", tensor_send_prev)) if t is not None}
        got = {k: torch.empty(3, device=dev, dtype=torch.int64)
               for k, want in (("prev", recv_prev), ("next", recv_next)) if want}
        ops = [(dist.isend, sent[k], self.next_rank if k == "next" else self.prev_rank)
               for k in ("next", "prev") if k in sent]
        ops += [(dist.irecv, got[k], self.prev_rank if k == "prev" else self.next_rank) for k in ("prev", "next")
                if k in got]
        if dev.type == "cuda" and ops:  # NCCL: one group of operations (one by one, both ranks' sends would wait)
            reqs = dist.batch_isend_irecv([dist.P2POp(op, t, peer, self.pp_group) for op, t, peer in ops])
        else:  # (gloo: matched in posting order)
            reqs = [op(t, peer, group=self.pp_group) for op, t, peer in ops]
        for req in reqs:
            req.wait()
        return (got["prev"].tolist() if "prev" in got else [0, 0, 0],
                got["next"].tolist() if "next" in got else [0, 0, 0])

    P2PCommunicator._communicate_shapes = communicate_shapes
    setattr(P2PCommunicator, _MARK, True)
