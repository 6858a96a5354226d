"""Peak memory of a piece of work, measured, not modelled.

CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) above what was allocated
before. CPU: PyTorch's profiler with memory events (`profile_memory=True`): every allocation event
carries the CPU allocator's running total of the bytes allocated since profiling began, so its peak
and its final value are the work's peak and what it kept. Both count only tensors allocated during
the work (parameters, and anything created before, are the baseline): "extra bytes this work needed
at its worst moment", and "bytes it left allocated". Caveat on CPU: a tensor whose last reference is
dropped on another thread (gloo's worker threads release the buffers of completed collectives) is
freed there, unseen by the profiler: under context parallelism the CPU figures are upper bounds
(measured: 800 all-gathers leave RSS flat while the profiler total grows).
"""

from __future__ import annotations

from typing import Callable

import torch


def peak_bytes(device: torch.device) -> int:
    """The process's high-water mark so far: CUDA allocator peak, or on CPU the peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def reset_peak(device: torch.device) -> int:
    """Start a peak measurement; returns the baseline (bytes in use now). CUDA: the allocator's;
    CPU (Linux): the resident set, whose high-water mark is reset through /proc/self/clear_refs."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _proc_status("VmRSS") or 0


def peak_since_reset(device: torch.device) -> int:
    """The high-water mark since `reset_peak` (bytes in use at the worst moment, baseline included)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _proc_status("VmHWM") or peak_bytes(device)


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
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # Every CPU allocation and free while profiling, with the allocator's running total of tracked
    # allocations (tensors that existed before profiling are neither counted nor subtracted).
    totals = []
    cpu_alloc = _EventType.Allocation
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:  # (a loop, not recursion: a capture makes millions of events)
        e = stack.pop()
        if e.tag == cpu_alloc and e.extra_fields.device.type == "cpu":
            f = e.extra_fields
            totals.append((e.start_time_ns, f.total_allocated, f.alloc_size))
        stack.extend(e.children)
    if not totals:
        return out, 0, 0, "cpu allocator totals (profiler allocation events)"
    totals.sort()
    # the running total is process-wide (tensors allocated under an earlier profile and still alive
    # are in it): the work's figures are relative to its value before the first event
    first = min(totals)
    base = first[1] - first[2]
    peak = max(t for _, t, _ in totals) - base
    retained = totals[-1][1] - base
    return out, int(peak), int(retained), "cpu allocator totals (profiler allocation events)"
