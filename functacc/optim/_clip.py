"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import torch
from torch import Tensor

from ._transform import GradientTransformation, Params, Updates

__all__ = ["clip_by_global_norm", "global_norm"]


def global_norm(grads: Updates) -> Tensor:
    """The 2-norm of all gradients taken as one vector (the norm of per-tensor norms)."""
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads.values()]
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
        if not grads:
            return grads, state
        coef = torch.clamp(max_norm / (global_norm(grads) + 1e-6), max=1.0)
        return {n: g.mul(coef.to(g.device)) for n, g in grads.items()}, state

    return GradientTransformation(init, update)
