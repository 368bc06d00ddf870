"""Adam and AdamW: ``torch.optim.Adam`` / ``AdamW``'s math as a pure transformation."""

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

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`.

    ``step``, ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq`` are per parameter, as in
    ``torch.optim.Adam``'s ``state[p]``, so the two convert into each other tensor for
    tensor. ``count`` counts updates (for schedules); ``lr`` is the learning rate of the
    last update (or the one to use, for a constant learning rate).
    """

    count: Tensor
    lr: Tensor
    step: dict[str, Tensor]
    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    max_exp_avg_sq: dict[str, Tensor]


def _step_dtype() -> torch.dtype:
    # torch.optim keeps `step` in float32, or float64 when that is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def adam(
    lr: float | Schedule = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> GradientTransformation:
    """Adam (Kingma & Ba, 2015) with the exact semantics of ``torch.optim.Adam``.

    ``weight_decay`` is L2 regularisation added to the gradient, unless
    ``decoupled_weight_decay=True`` (that is :func:`adamw`).

    Example:
        >>> import functacc
        >>> opt = functacc.optim.adam(3e-4, betas=(0.9, 0.95))
    """
    lr0 = initial_lr(lr)
    beta1, beta2 = (float(b) for b in betas)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1); got {betas}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"eps and weight_decay must be >= 0; got eps={eps}, wd={weight_decay}")

    def init(params: Params) -> AdamState:
        like = first_tensor(params)
        zeros = {
            n: torch.zeros_like(p, memory_format=torch.preserve_format) for n, p in params.items()
        }
        return AdamState(
            count=scalar_state(0, dtype=torch.int64, like=like),
            lr=scalar_state(lr0, dtype=torch.float64, like=like),
            step={
                n: torch.zeros((), dtype=_step_dtype(), device=p.device) for n, p in params.items()
            },
            exp_avg=zeros,
            exp_avg_sq={n: torch.zeros_like(z) for n, z in zeros.items()},
            max_exp_avg_sq={n: torch.zeros_like(z) for n, z in zeros.items()} if amsgrad else {},
        )

    def update_params(grads: Updates, state: AdamState, params: Params) -> tuple[dict, AdamState]:
        step_lr = learning_rate(lr, state.count, state.lr)
        steps, exp_avgs = dict(state.step), dict(state.exp_avg)
        exp_avg_sqs, max_sqs = dict(state.exp_avg_sq), dict(state.max_exp_avg_sq)
        new_params = {}
        for name, grad in grads.items():
            param = params[name]
            if maximize:
                grad = -grad
            step = state.step[name] + 1
            if weight_decay != 0 and not decoupled_weight_decay:
                grad = grad.add(param, alpha=weight_decay)
            # The same ATen ops, in the same order, as torch.optim's single-tensor Adam; the
            # bias corrections are float64 like the Python floats torch computes them in.
            exp_avg = state.exp_avg[name].lerp(grad, 1 - beta1)
            exp_avg_sq = state.exp_avg_sq[name].mul(beta2).addcmul(grad, grad, value=1 - beta2)
            step64 = step.to(torch.float64)
            bias_correction1 = 1 - torch.pow(beta1, step64)
            bias_correction2_sqrt = torch.pow(1 - torch.pow(beta2, step64), 0.5)
            step_size = step_lr / bias_correction1
            if amsgrad:
                max_sqs[name] = torch.maximum(state.max_exp_avg_sq[name], exp_avg_sq)
                denom = (max_sqs[name].sqrt() / bias_correction2_sqrt).add(eps)
            else:
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add(eps)
            if weight_decay != 0 and decoupled_weight_decay:
                param = param.mul(1 - step_lr * weight_decay)
            # torch: param.addcdiv_(exp_avg, denom, value=-step_size), whose kernel computes
            # param + (-step_size * exp_avg) / denom; the same order rounds the same way.
            new_params[name] = param + exp_avg * -step_size / denom
            steps[name], exp_avgs[name], exp_avg_sqs[name] = step, exp_avg, exp_avg_sq
        new_state = AdamState(state.count + 1, step_lr, steps, exp_avgs, exp_avg_sqs, max_sqs)
        return new_params, new_state

    return from_params_update(init, update_params)


def adamw(
    lr: float | Schedule = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019): Adam with decoupled weight decay, as
    ``torch.optim.AdamW`` (``param *= 1 - lr * weight_decay`` before the Adam step).

    Example:
        >>> import functacc
        >>> opt = functacc.optim.adamw(1e-3, weight_decay=0.05)
    """
    return adam(
        lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        decoupled_weight_decay=True,
    )
