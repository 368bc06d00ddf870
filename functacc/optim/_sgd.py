"""SGD with momentum, dampening, Nesterov and L2 weight decay: ``torch.optim.SGD``'s math."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._transform import (
    EagerKernel,
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
        # torch's add(..., alpha=number): one fused multiply-add. Each torch kernel is one
        # EagerKernel: computed in its op-math type, rounded once (bf16/fp16 parameters).
        for name, grad in grads.items():
            param = params[name]
            k = EagerKernel(param.dtype)
            if maximize:
                grad = -grad
            if use_decay:  # grad.add(param, alpha=weight_decay)
                grad = k(torch.addcmul(k.up(grad), k.up(param), k.alpha(hyper["weight_decay"])))
            if use_momentum:
                momentum_t = k.factor(hyper["momentum"])
                # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                decayed = k(
                    torch.addcmul(
                        k.up(k(k.up(state.momentum_buffer[name]) * momentum_t)),
                        k.up(grad),
                        k.alpha(1 - hyper["dampening"]),
                    )
                )
                # torch starts the buffer as an undamped copy of the first gradient.
                buffers[name] = torch.where(state.initialized[name], decayed, grad)
                initialized[name] = torch.ones_like(state.initialized[name])
                if nesterov:  # grad.add(buf, alpha=momentum)
                    alpha = k.alpha(hyper["momentum"])
                    grad = k(torch.addcmul(k.up(grad), k.up(buffers[name]), alpha))
                else:
                    grad = buffers[name]
            # param.add_(grad, alpha=-lr)
            new_params[name] = k(torch.addcmul(k.up(param), k.up(grad), k.alpha(-hyper["lr"])))
        return new_params, SGDState(state.count + 1, hyper, buffers, initialized)

    return from_params_update(init, update_params)
