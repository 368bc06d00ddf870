"""Adam and AdamW: ``torch.optim.Adam`` / ``AdamW``'s math as a pure transformation."""

from __future__ import annotations

from collections.abc import Mapping
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

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw`.

    ``hyperparams`` holds ``lr``, ``beta1``, ``beta2``, ``eps`` and ``weight_decay`` as
    0-dim float64 tensors (data: changing them never retraces). ``step``, ``exp_avg``,
    ``exp_avg_sq`` and ``max_exp_avg_sq`` are per parameter, as ``torch.optim.Adam``'s
    ``state[p]``, so the two convert into each other tensor for tensor.
    """

    count: Tensor
    hyperparams: dict[str, Tensor]
    step: dict[str, Tensor]
    exp_avg: dict[str, Tensor]
    exp_avg_sq: dict[str, Tensor]
    max_exp_avg_sq: dict[str, Tensor]


def step_dtype() -> torch.dtype:
    """torch.optim keeps ``step`` in float32, or float64 when that is the default dtype."""
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
    tensor_dtypes: Mapping[str, torch.dtype] | None = None,
) -> GradientTransformation:
    """Adam (Kingma & Ba, 2015) with the exact semantics of ``torch.optim.Adam``.

    ``weight_decay`` is L2 regularisation added to the gradient, unless
    ``decoupled_weight_decay=True`` (that is :func:`adamw`). ``tensor_dtypes`` names the
    hyperparameters (``"lr"``, ``"beta1"``, ``"beta2"``) that a ``torch.optim.Adam`` being
    matched holds as tensors, e.g. ``lr=torch.tensor(1e-3)``: torch does their scalar
    arithmetic (bias corrections, step size) in that dtype, not in Python floats.

    Example:
        >>> import functacc
        >>> opt = functacc.optim.adam(3e-4, betas=(0.9, 0.95))
    """
    initial_lr(lr)  # validates
    beta1, beta2 = (float(b) for b in betas)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1); got {betas}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"eps and weight_decay must be >= 0; got eps={eps}, wd={weight_decay}")
    use_decay = weight_decay != 0
    values = {"beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    # A float64 tensor computes as a Python float does.
    dtypes = {k: d for k, d in (tensor_dtypes or {}).items() if d != torch.float64}
    unknown = set(dtypes) - {"lr", "beta1", "beta2"}
    if unknown:
        raise ValueError(f"tensor_dtypes may name lr, beta1, beta2; got {sorted(unknown)}")

    def init(params: Params) -> AdamState:
        like = first_tensor(params)
        device = like.device if like is not None else None

        def zeros() -> dict[str, Tensor]:
            return {
                n: torch.zeros_like(p, memory_format=torch.preserve_format)
                for n, p in params.items()
            }

        return AdamState(
            count=torch.zeros((), dtype=torch.int64, device=device),
            hyperparams=hyperparameters(lr, values, like),
            step={
                n: torch.zeros((), dtype=step_dtype(), device=p.device) for n, p in params.items()
            },
            exp_avg=zeros(),
            exp_avg_sq=zeros(),
            max_exp_avg_sq=zeros() if amsgrad else {},
        )

    def update_params(grads: Updates, state: AdamState, params: Params) -> tuple[dict, AdamState]:
        hyper = scheduled_lr(lr, state)
        # Each hyperparameter as torch computes with it: a Python float (float64 here), or
        # a tensor of its own dtype.
        lr_t, beta1_t, beta2_t = (
            hyper[k].to(dtypes[k]) if k in dtypes else hyper[k] for k in ("lr", "beta1", "beta2")
        )
        steps, exp_avgs = dict(state.step), dict(state.exp_avg)
        exp_avg_sqs, max_sqs = dict(state.exp_avg_sq), dict(state.max_exp_avg_sq)
        new_params = {}
        # The same ATen ops, in the same order, as torch.optim's single-tensor Adam. torch
        # computes the scalar factors as Python floats (float64); they are float64 0-dim
        # tensors here, used at each kernel's op-math precision (EagerKernel: float32 for
        # bf16/fp16 parameters, rounded once per torch kernel; the dtype itself otherwise).
        for name, grad in grads.items():
            param = params[name]
            k = EagerKernel(param.dtype)
            if maximize:
                grad = -grad
            step = state.step[name] + 1
            if use_decay and not decoupled_weight_decay:  # grad.add(param, alpha=wd)
                grad = k(torch.addcmul(k.up(grad), k.up(param), k.alpha(hyper["weight_decay"])))
            # exp_avg.lerp_(grad, 1 - beta1)
            exp_avg = k(k.up(state.exp_avg[name]).lerp(k.up(grad), k.factor(1 - beta1_t)))
            # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            decayed_sq = k(k.up(state.exp_avg_sq[name]) * k.factor(beta2_t))
            exp_avg_sq = k(
                torch.addcmul(k.up(decayed_sq), k.up(grad) * k.factor(1 - beta2_t), k.up(grad))
            )
            bias_correction1 = 1 - _pow_step(beta1_t, step)
            bias_correction2_sqrt = torch.pow(1 - _pow_step(beta2_t, step), 0.5)
            step_size = _div(lr_t, bias_correction1)
            if amsgrad:
                max_sqs[name] = torch.maximum(state.max_exp_avg_sq[name], exp_avg_sq)
                second = max_sqs[name]
            else:
                second = exp_avg_sq
            # (second.sqrt() / bias_correction2_sqrt).add_(eps): three kernels. The square
            # root is torch's own kernel in the tensor's dtype: its fp16 CPU kernel does not
            # always round as float32's sqrt rounded to fp16 would (15 of the 30,720 positive
            # normal fp16 values, e.g. 0.01561737 -> 0.12494, not 0.125).
            root = second.sqrt()
            denom = k(k.up(k(k.up(root) / k.factor(bias_correction2_sqrt))) + k.alpha(hyper["eps"]))
            if use_decay and decoupled_weight_decay:  # param.mul_(1 - lr * weight_decay)
                param = k(k.up(param) * k.factor(1 - _mul(lr_t, hyper["weight_decay"])))
            # torch: param.addcdiv_(exp_avg, denom, value=-step_size), whose kernel computes
            # param + (-step_size * exp_avg) / denom; the same order rounds the same way.
            new_params[name] = k(k.up(param) + k.up(exp_avg) * k.factor(-step_size) / k.up(denom))
            steps[name], exp_avgs[name], exp_avg_sqs[name] = step, exp_avg, exp_avg_sq
        new_state = AdamState(state.count + 1, hyper, steps, exp_avgs, exp_avg_sqs, max_sqs)
        return new_params, new_state

    return from_params_update(init, update_params)


def _pow_step(beta: Tensor, step: Tensor) -> Tensor:
    """``beta ** step.item()`` as torch computes it: Python's float power, or for a tensor
    ``beta`` ATen's power by a Python-float exponent, which squares and cubes in the tensor's
    dtype and otherwise raises in float64 and rounds once."""
    step64 = step.to(torch.float64)
    if beta.dtype == torch.float64:
        return torch.pow(beta, step64)
    general = torch.pow(beta.to(torch.float64), step64).to(beta.dtype)
    return torch.where(
        step64 == 2, beta * beta, torch.where(step64 == 3, beta * beta * beta, general)
    )


def _common(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` as torch combines a Python float (float64 here) with a tensor
    hyperparameter: the float joins the tensor's dtype."""
    if a.dtype == b.dtype:
        return a, b
    dtype = a.dtype if a.dtype != torch.float64 else b.dtype
    return a.to(dtype), b.to(dtype)


def _div(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype == torch.float64 and b.dtype != torch.float64:
        # A Python float over a tensor is Tensor.__rtruediv__: reciprocal(b) * a.
        return torch.reciprocal(b) * a.to(b.dtype)
    a, b = _common(a, b)
    return a / b


def _mul(a: Tensor, b: Tensor) -> Tensor:
    a, b = _common(a, b)
    return a * b


def adamw(
    lr: float | Schedule = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    tensor_dtypes: Mapping[str, torch.dtype] | None = None,
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
        tensor_dtypes=tensor_dtypes,
    )
