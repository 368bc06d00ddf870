"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ._transform import GradientTransformation, Params, Updates

__all__ = ["clip_by_global_norm", "global_norm"]


# Set while an optimizer steps a part of the parameters (ZeRO: those this rank owns): the
# process group the squares of global_norm are summed over, and a tensor on their device.
_SUMMED: contextvars.ContextVar[tuple[Any, Tensor] | None] = contextvars.ContextVar(
    "functacc_global_norm_summed_over", default=None
)


@contextlib.contextmanager
def summed_over(group: Any, like: Tensor) -> Iterator[None]:
    """While inside, :func:`global_norm` sums its squares over ``group``'s ranks (each holds
    some of the gradients); ``group=None``: the gradients given are all of them."""
    token = _SUMMED.set((group, like) if group is not None else None)
    try:
        yield
    finally:
        _SUMMED.reset(token)


def global_norm(grads: Updates) -> Tensor:
    """The 2-norm of all gradients taken as one vector (the norm of per-tensor norms).
    Under ZeRO (:func:`summed_over`) the squares of every rank's gradients are summed."""
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads.values()]
    summed = _SUMMED.get()
    if summed is not None:
        from torch.distributed import _functional_collectives as funcol

        group, like = summed
        squares = torch.zeros((), dtype=like.dtype, device=like.device)  # a rank may hold none
        if norms:
            squares = torch.stack([n.to(like.device) for n in norms]).square().sum()
        return funcol.wait_tensor(funcol.all_reduce(squares, "sum", group)).sqrt()
    if not norms:
        return torch.zeros(())
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all gradients by ``min(1, max_norm / (global_norm + 1e-6))``.

    The same formula as ``torch.nn.utils.clip_grad_norm_`` and, like it, no data-dependent
    branch: the clamped coefficient is always applied, so no host synchronisation happens.

    Example:
        >>> import functacc
        >>> opt = functacc.optim.chain(
        ...     functacc.optim.clip_by_global_norm(1.0), functacc.optim.sgd(0.1)
        ... )
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0; got {max_norm}")
    max_norm = float(max_norm)

    def init(params: Params) -> tuple:
        return ()

    def update(grads: Updates, state: tuple, params: Params) -> tuple[Updates, tuple]:
        if not grads and _SUMMED.get() is None:  # under ZeRO every rank sums its part
            return grads, state
        coef = torch.clamp(max_norm / (global_norm(grads) + 1e-6), max=1.0)
        return {n: g.mul(coef.to(g.device)) for n, g in grads.items()}, state

    return GradientTransformation(init, update)
