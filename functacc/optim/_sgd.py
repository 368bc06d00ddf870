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
    hyperparameters,
    initial_lr,
    scheduled_lr,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    ``hyperparams`` holds ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` as 0-dim
    float64 tensors: they are data, so changing them (by hand or by a scheduler) never
    retraces a compiled step. ``momentum_buffer`` holds the same tensors as
    ``torch.optim.SGD``'s ``state[p]["momentum_buffer"]``. torch creates that buffer lazily as
    a copy of the first gradient; here it exists from the start (zeros) and ``initialized``
    records whether a gradient has been folded in yet.
    """

    count: Tensor
    hyperparams: dict[str, Tensor]
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

    ``momentum == 0`` (no buffers) and ``weight_decay == 0`` are structural choices fixed
    here; the values themselves live in the state and may change between steps.

    Example:
        >>> import functacc
        >>> opt = functacc.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    """
    initial_lr(lr)  # validates
    if momentum < 0 or weight_decay < 0 or dampening < 0:
        raise ValueError(
            f"momentum, dampening and weight_decay must be >= 0; got momentum={momentum}, "
            f"dampening={dampening}, weight_decay={weight_decay}"
        )
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            "nesterov=True needs momentum > 0 and dampening == 0 (as in torch.optim.SGD); "
            f"got momentum={momentum}, dampening={dampening}"
        )
    use_momentum, use_decay = momentum != 0, weight_decay != 0
    values = {"momentum": momentum, "dampening": dampening, "weight_decay": weight_decay}

    def init(params: Params) -> SGDState:
        buffers, initialized = {}, {}
        if use_momentum:
            for name, p in params.items():
                buffers[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                initialized[name] = torch.zeros((), dtype=torch.bool, device=p.device)
        like = first_tensor(params)
        count = torch.zeros((), dtype=torch.int64, device=like.device if like is not None else None)
        return SGDState(count, hyperparameters(lr, values, like), buffers, initialized)

    def update_params(grads: Updates, state: SGDState, params: Params) -> tuple[dict, SGDState]:
        hyper = scheduled_lr(lr, state)
        new_params = {}
        buffers, initialized = dict(state.momentum_buffer), dict(state.initialized)
        # Hyperparameters are 0-dim tensors; addcmul with a tensor factor rounds exactly like
        # torch's add(..., alpha=number): one fused multiply-add.
        for name, grad in grads.items():
            param = params[name]
            dtype = param.dtype
            if maximize:
                grad = -grad
            if use_decay:
                grad = torch.addcmul(grad, param, hyper["weight_decay"].to(dtype))
            if use_momentum:
                momentum_t = hyper["momentum"].to(dtype)
                decayed = torch.addcmul(
                    state.momentum_buffer[name].mul(momentum_t),
                    grad,
                    (1 - hyper["dampening"]).to(dtype),
                )
                # torch starts the buffer as an undamped copy of the first gradient.
                buffers[name] = torch.where(state.initialized[name], decayed, grad)
                initialized[name] = torch.ones_like(state.initialized[name])
                grad = torch.addcmul(grad, buffers[name], momentum_t) if nesterov else buffers[name]
            new_params[name] = torch.addcmul(param, grad, (-hyper["lr"]).to(dtype))
        return new_params, SGDState(state.count + 1, hyper, buffers, initialized)

    return from_params_update(init, update_params)
