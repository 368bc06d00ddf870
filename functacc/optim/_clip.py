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


# Set while an optimizer steps a part of the parameters (ZeRO: those this rank owns;
# TensorParallel: slices of some): the process group the squares of global_norm are summed
# over, a tensor on their device, and the split parameters' names and their group.
_SUMMED: contextvars.ContextVar[tuple[Any, Tensor, Any] | None] = contextvars.ContextVar(
    "functacc_global_norm_summed_over", default=None
)


@contextlib.contextmanager
def summed_over(group: Any, like: Tensor, split: tuple[Any, Any] | None = None) -> Iterator[None]:
    """While inside, :func:`global_norm` sums its squares over ``group``'s ranks (each holds
    some of the gradients; ``None``: the gradients given are all of them), and ``split``'s
    ``(names, split_group)`` over ``split_group`` (tensor parallelism: each rank holds a
    slice of those parameters, the same whole copy of the others)."""
    on = group is not None or split is not None
    token = _SUMMED.set((group, like, split) if on else None)
    try:
        yield
    finally:
        _SUMMED.reset(token)


def global_norm(grads: Updates) -> Tensor:
    """The 2-norm of all gradients taken as one vector (the norm of per-tensor norms).
    Under ZeRO (:func:`summed_over`) the squares of every rank's gradients are summed."""
    summed = _SUMMED.get()
    if summed is not None:
        group, like, split = summed
        names = split[0] if split is not None else ()
        squares = _squares([g for n, g in grads.items() if n not in names], like)
        if split is not None:
            squares = squares + _sum(
                _squares([g for n, g in grads.items() if n in names], like), split[1]
            )
        return (_sum(squares, group) if group is not None else squares).sqrt()
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads.values()]
    if not norms:
        return torch.zeros(())
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)


def _squares(grads: list[Tensor], like: Tensor) -> Tensor:
    """The sum of the squares of ``grads`` (zero where a rank holds none)."""
    if not grads:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    norms = [torch.linalg.vector_norm(g, 2.0).to(like.device) for g in grads]
    return torch.stack(norms).square().sum()


def _sum(value: Tensor, group: Any) -> Tensor:
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(value, "sum", group))


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
