"""Run the model through Megatron's pipeline engine (`get_forward_backward_func`).

`forward_backward(model, par, batches, loss_fn, forward_only)` feeds each micro-batch of token ids
through the stages with Megatron's schedule (no pipelining for pp=1, 1F1B otherwise) and returns,
on every rank, the per-micro-batch values `loss_fn` reported on the last stage. `loss_fn` receives
the vocab-parallel logits `[B, S, V/tp]` and returns `(scalar loss, dict of float metrics)`; the
schedule divides the loss by the number of micro-batches, as Megatron does.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def forward_backward(model, par, batches: list[torch.Tensor], loss_fn: Callable, forward_only: bool = False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not batches:
        raise ValueError("forward_backward: no micro-batches")
    shape = tuple(batches[0].shape)
    if any(tuple(b.shape) != shape for b in batches):
        raise ValueError(f"micro-batches must share one shape [B, S]; got {[tuple(b.shape) for b in batches]}")
    it = iter(batches)

    def forward_step(data_iterator, model_):
        ids = next(data_iterator).to(par.device)
        out = model_(ids)

        return out, loss_fn

    fb = get_forward_backward_func(pp_size=par.pp)
    kwargs = dict(forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=len(batches),
                  seq_length=shape[1], micro_batch_size=shape[0], forward_only=forward_only)
    if par.pp > 1:  # explicit groups: Megatron wants the communicator and the collection together
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        kwargs.update(p2p_communicator=P2PCommunicator(pp_group=par.pgs.pp, config=model.config),
                      pg_collection=par.pgs)
    results = fb(**kwargs)
    # Results live on the last stage; give every rank the same list.
    if par.pp == 1:
        return results
    box = [results if par.is_last_stage else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(par.pgs.pp, par.pp - 1), group=par.pgs.pp)
    return box[0]
