"""Learning-rate schedules: pure functions of the update count, evaluated inside the graph.

A schedule maps the 0-dim int64 count of updates already applied to a 0-dim float64
learning rate. Because it is tensor math, changing step counts never retraces the step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._transform import Schedule

__all__ = ["constant", "cosine_decay", "linear_warmup"]


def _as_float(count: Tensor) -> Tensor:
    return torch.as_tensor(count).to(torch.float64)


def constant(value: float) -> Schedule:
    """Always ``value``.

    Example:
        >>> import torch, functacc
        >>> functacc.optim.constant(0.1)(torch.tensor(7))
        tensor(0.1000, dtype=torch.float64)
    """

    def schedule(count: Tensor) -> Tensor:
        return torch.full_like(_as_float(count), float(value))

    return schedule


def linear_warmup(
    peak_value: float,
    warmup_steps: int,
    *,
    init_value: float = 0.0,
    after: Schedule | None = None,
) -> Schedule:
    """Ramp linearly from ``init_value`` to ``peak_value`` over ``warmup_steps`` updates,
    then hold ``peak_value`` (or follow ``after``, evaluated at ``count - warmup_steps``).

    Example:
        >>> import torch, functacc
        >>> s = functacc.optim.linear_warmup(1.0, 4)
        >>> [round(float(s(torch.tensor(i))), 2) for i in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be > 0; got {warmup_steps}")

    def schedule(count: Tensor) -> Tensor:
        c = _as_float(count)
        frac = torch.clamp(c / warmup_steps, max=1.0)
        ramp = init_value + (peak_value - init_value) * frac
        if after is None:
            return ramp
        rest = torch.as_tensor(after(torch.clamp(c - warmup_steps, min=0.0))).to(torch.float64)
        return torch.where(c < warmup_steps, ramp, rest)

    return schedule


def cosine_decay(init_value: float, decay_steps: int, *, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``
    updates (Loshchilov & Hutter, 2017), constant afterwards.

    Example:
        >>> import torch, functacc
        >>> s = functacc.optim.cosine_decay(1.0, 10)
        >>> float(s(torch.tensor(5)))
        0.5
    """
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0; got {decay_steps}")

    def schedule(count: Tensor) -> Tensor:
        frac = torch.clamp(_as_float(count) / decay_steps, max=1.0)
        cosine = 0.5 * (1.0 + torch.cos(math.pi * frac))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule
