"""Peak memory of one call, on CPU (from the profiler's allocation events) or CUDA."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["peak_memory"]


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints start/stop notices from C++ on fd 2; keep benchmark output clean."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(fn: Callable[[], Any], *, device: torch.device | str = "cpu") -> int:
    """Bytes allocated at the high point of ``fn()``, above what was live when it started.

    On CUDA this is ``torch.cuda.max_memory_allocated``. On CPU PyTorch keeps no such
    counter, so the profiler records every allocation and free, and the running sum of those
    events gives the peak. Both count tensors only, not the Python heap.

    Example:
        >>> import torch
        >>> peak_memory(lambda: torch.ones(1024, 1024).sum()) >= 4 * 1024 * 1024
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
