"""SGD with momentum, dampening, Nesterov and L2 weight decay: ``torch.optim.SGD``'s math."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._transform import (
    GradientTransformation,
    Params,
    Schedule,
    Updates,
    first_tensor,
    from_params_update,
    initial_lr,
    learning_rate,
    scalar_state,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    ``momentum_buffer`` holds the same tensors as ``torch.optim.SGD``'s
    ``state[p]["momentum_buffer"]``. torch creates the buffer lazily as a copy of the first
    gradient; here it exists from the start (zeros) and ``initialized`` records whether a
    gradient has been folded in yet, so the first step needs no retrace.
    """

    count: Tensor
    lr: Tensor
    momentum_buffer: dict[str, Tensor]
    initialized: dict[str, Tensor]


def sgd(
    lr: float | Schedule = 1e-3,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with the exact semantics of ``torch.optim.SGD``.

    Example:
        >>> import functacc
        >>> opt = functacc.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    """
    lr0 = initial_lr(lr)
    if momentum < 0 or weight_decay < 0:
        raise ValueError(
            f"momentum and weight_decay must be >= 0; got momentum={momentum}, "
            f"weight_decay={weight_decay}"
        )
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            "nesterov=True needs momentum > 0 and dampening == 0 (as in torch.optim.SGD); "
            f"got momentum={momentum}, dampening={dampening}"
        )

    def init(params: Params) -> SGDState:
        like = first_tensor(params)
        buffers = {}
        initialized = {}
        if momentum != 0:
            for name, p in params.items():
                buffers[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                initialized[name] = torch.zeros((), dtype=torch.bool, device=p.device)
        return SGDState(
            count=scalar_state(0, dtype=torch.int64, like=like),
            lr=scalar_state(lr0, dtype=torch.float64, like=like),
            momentum_buffer=buffers,
            initialized=initialized,
        )

    def update_params(grads: Updates, state: SGDState, params: Params) -> tuple[dict, SGDState]:
        step_lr = learning_rate(lr, state.count, state.lr)
        new_params = {}
        buffers = dict(state.momentum_buffer)
        initialized = dict(state.initialized)
        for name, grad in grads.items():
            param = params[name]
            if maximize:
                grad = -grad
            if weight_decay != 0:
                grad = grad.add(param, alpha=weight_decay)
            if momentum != 0:
                buf = state.momentum_buffer[name]
                decayed = buf.mul(momentum).add(grad, alpha=1 - dampening)
                if dampening != 0:
                    # torch starts the buffer as a copy of the first gradient, undamped. With
                    # dampening == 0 the zero-initialised buffer gives that value exactly.
                    decayed = torch.where(state.initialized[name], decayed, grad)
                buffers[name] = decayed
                initialized[name] = torch.ones_like(state.initialized[name])
                grad = grad.add(decayed, alpha=momentum) if nesterov else decayed
            # torch: param.add_(grad, alpha=-lr), one fused multiply-add; addcmul with the
            # learning rate as a tensor rounds the same way and never retraces on lr changes.
            new_params[name] = torch.addcmul(param, grad, (-step_lr).to(param.dtype))
        new_state = SGDState(state.count + 1, step_lr, buffers, initialized)
        return new_params, new_state

    return from_params_update(init, update_params)
