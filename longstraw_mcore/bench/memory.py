"""Peak memory of a piece of work, measured, not modelled.

CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) above what was allocated
before. CPU: PyTorch's profiler with memory events (`profile_memory=True`): its memory timeline
replays every allocation and free made during the work, and the peak of the live total is taken.
Both count only tensors allocated during the work (parameters, and anything created before, are
the baseline), so the figure is "extra bytes this work needed at its worst moment".
"""

from __future__ import annotations

from typing import Callable

import torch


def measure_peak(fn: Callable[[], object], device: torch.device) -> tuple[object, int, str]:
    """Run `fn()`; return (its result, peak extra bytes, how it was measured)."""
    out, peak, _, how = measure_memory(fn, device)
    return out, peak, how


def measure_memory(fn: Callable[[], object], device: torch.device) -> tuple[object, int, int, str]:
    """Run `fn()`; return (its result, peak extra bytes, bytes still held when it returned (what it
    allocated and kept), how it was measured)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return (out, int(torch.cuda.max_memory_allocated(device) - base),
                int(torch.cuda.memory_allocated(device) - base), "cuda allocator")
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        out = fn()
    from torch.profiler._memory_profiler import Action

    timeline = MemoryProfileTimeline(prof._memory_profile())
    _, sizes = timeline._coalesce_timeline(torch.device("cpu"))
    # tensors that existed before (parameters, the state, ...) enter the timeline as PREEXISTING
    # once the work touches them: they are the baseline, not the work's memory
    base = sum(n for _, action, (key, _), n in timeline.timeline
               if action == Action.PREEXISTING and key.device == torch.device("cpu"))
    peak = max((sum(s) for s in sizes), default=base) - base
    retained = (sum(sizes[-1]) if sizes else base) - base
    return out, int(peak), int(retained), "cpu profiler memory timeline"
