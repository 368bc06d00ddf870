"""What fraction of the machine a step uses: the measured fp32 matmul peak and a step's FLOPs.

Example:
    >>> peak = matmul_peak_flops()  # doctest: +SKIP
    >>> flops = step_flops(model, inputs, targets, loss_fn)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import time

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["matmul_peak_flops", "step_flops"]


def matmul_peak_flops(
    device: torch.device | str = "cpu",
    n: int = 2048,
    seconds: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> float:
    """The best of several timed ``n x n`` matmuls in ``dtype``, in FLOP/s: what this
    machine's BLAS reaches with all its threads, the ceiling a training step is measured
    against (on CUDA float32 runs without TF32 unless the user turned it on)."""
    device = torch.device(device)
    if device.type == "cuda":
        n = max(n, 8192)  # a GPU needs a larger product to reach its rate
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best


def step_flops(model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: nn.Module) -> int:
    """FLOPs of one forward and backward (matmuls, convolutions, attention: what PyTorch's
    ``FlopCounterMode`` counts); the optimizer's elementwise work is not counted."""
    model = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(inputs), targets).backward()
    return counter.get_total_flops()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
