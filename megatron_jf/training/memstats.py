"""Peak memory of a piece of work, on CPU and GPU, for tests and benchmarks.

``tracemalloc`` does not see torch's allocations, and torch has no allocator statistics for CPU
tensors. On CPU the torch profiler (``profile_memory=True``) records every allocation and free of the
CPU allocator with its size; replaying them in time order gives the live bytes and their peak. On GPU
``torch.cuda.max_memory_allocated`` gives the same figure directly.
"""

from __future__ import annotations

import torch

__all__ = ["peak_bytes"]


def peak_bytes(fn, *, device: torch.device | str | None = None) -> tuple[int, object]:
    """Run ``fn()`` and return ``(peak, result)``: the peak of the bytes allocated by torch *during* the
    call above what was live when it started (tensors already alive do not count, tensors that ``fn``
    returns count while alive), and ``fn``'s return value.

    Args:
        fn: a callable without arguments.
        device: where the work runs (default: CUDA when available, else CPU).

    Returns:
        ``(bytes (int), fn())``.
    """
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - base), out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return int(peak), out
