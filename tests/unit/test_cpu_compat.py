"""Each CPU patch in cpu_compat, exercised at (or like) the Megatron call site it serves, in a fresh
process; and nothing patched when the configured device is cuda (on a machine with or without a GPU)."""

from __future__ import annotations

from longstraw_mcore.launch_local import run_ranks


def _cpu_worker(rank, world_size):
    import numpy as np
    import torch

    from longstraw_mcore import cpu_compat

    assert cpu_compat.enable("cpu") and cpu_compat.enable("cpu")  # idempotent
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.utils import get_default_causal_mask

    checks = {}
    checks["current_device_int"] = torch.cuda.current_device() == 0
    checks["factory_device_cuda"] = torch.zeros(2, device="cuda").device.type == "cpu"
    checks["factory_device_ordinal"] = torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    checks["pin_memory"] = torch.ones(2, pin_memory=True).device.type == "cpu"
    x = torch.ones(3)
    checks["tensor_cuda"] = x.cuda(non_blocking=True) is x
    checks["tensor_to_cuda"] = x.to("cuda").device.type == "cpu" and x.to(torch.float64).dtype == torch.float64
    checks["type_string"] = x.type() == "torch.cuda.FloatTensor" and x.double().type() == "torch.cuda.DoubleTensor"
    with torch.cuda.stream(torch.cuda.Stream()):
        ev = torch.cuda.Event()
        ev.record()
        torch.cuda.current_stream().wait_event(ev)
    torch.cuda.synchronize()
    checks["streams_events_sync"] = True
    parallel_state.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    checks["rng_tracker_fork"] = a.shape == (3,)
    split = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    checks["moe_split_sizes_numpy"] = isinstance(split, np.ndarray) and split.tolist() == [1, 2]
    checks["causal_mask_site"] = get_default_causal_mask(4).device.type == "cpu"  # transformer/utils.py:39
    checks["rotary_site"] = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(5).device.type == "cpu"

    class _Alloc(torch.autograd.Function):  # tensor_parallel/mappings.py:444, reached from a backward
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, g):
            return g.new_empty(size=[3], device=torch.cuda.current_device()).fill_(1.0)

    t = torch.zeros(3, requires_grad=True)
    _Alloc.apply(t).sum().backward()  # autograd runs this backward with torch function modes off
    checks["new_empty_in_backward"] = t.grad.device.type == "cpu" and bool((t.grad == 1).all())
    parallel_state.destroy_model_parallel()
    return checks


def _cuda_worker(rank, world_size):
    import torch

    from longstraw_mcore import cpu_compat

    assert not cpu_compat.enable("cuda")
    out = {"not_enabled": not cpu_compat.is_enabled()}
    # not redirected: a real CUDA tensor where a GPU exists, the usual failure where none does
    try:
        out["cuda_alloc_untouched"] = torch.zeros(1, device="cuda").device.type == "cuda"
    except (RuntimeError, AssertionError):
        out["cuda_alloc_untouched"] = not torch.cuda.is_available()
    out["synchronize_untouched"] = torch.cuda.synchronize.__module__.startswith("torch")
    return out


def test_cpu_patches_each_call_site():
    checks = run_ranks(_cpu_worker, 1, timeout_s=300)[0]
    failed = [k for k, ok in checks.items() if not ok]
    assert not failed, failed
    assert len(checks) == 13


def test_nothing_patched_for_cuda_device():
    out = run_ranks(_cuda_worker, 1, timeout_s=300)[0]
    assert all(out.values()), out
