"""``compile_step``'s standard body (:func:`standard_body`) and what it is made of: the
argument checks, the loss checks, micro-batches, and :class:`TrainState`, the form of the
step's state for its pure call (``step.init_state()``, ``step.apply(state, ...)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..core.diagnostics import describe_tensor
from ..core.functional import unwrap
from ..errors import argument_error

__all__ = ["LossFn", "TrainState", "loss_modules", "standard_body"]

LossFn = Callable[[Any, Any], Tensor]


class TrainState(NamedTuple):
    """Everything a training step reads and writes.

    ``params`` and ``buffers`` are keyed like ``model.named_parameters()`` /
    ``named_buffers()``; ``opt_state`` is the optimizer's state
    (:mod:`functacc.frontends.body_pure` gives its form); ``count`` is the number of steps
    taken (0-dim int64 tensor); ``extra`` holds the float16 loss scaler's state.
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: Any
    count: Tensor
    extra: dict[str, Any] | None = None


def check_step_arguments(
    model: Any, loss_fn: Any, grad_accum_steps: Any, max_grad_norm: Any
) -> nn.Module:
    """The model (unwrapped from DDP or torch.compile), after checking ``compile_step``'s
    arguments that every pipeline takes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            "loss_fn must be callable as loss_fn(outputs, targets) -> 0-dim tensor, or None "
            f"when the model returns its own loss; got {type(loss_fn).__name__}"
        )
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an int >= 1; got {grad_accum_steps!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None; got {max_grad_norm!r}")
    return unwrap(model)


def check_grad_enabled() -> None:
    """A training step called under ``torch.no_grad()`` or ``inference_mode()`` is an error:
    eager PyTorch cannot train there either (``backward()`` fails without autograd)."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "the training step was called with gradients disabled (inside torch.no_grad() "
            "or torch.inference_mode()); a training step needs autograd, as loss.backward() "
            "does in eager PyTorch. Call it outside that context."
        )


def checked_loss(loss: Any, what: str) -> Tensor:
    """``loss`` if it is a 0-dim floating-point tensor, else a clear error."""
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = describe_tensor(loss) if isinstance(loss, Tensor) else type(loss).__name__
        raise argument_error(
            f"{what} must be a 0-dim floating-point tensor (the value to minimise); got "
            f"{got}. Reduce it to a scalar, e.g. with reduction='mean' or loss.mean()."
        )
    return loss


def no_gradient_error() -> Exception:
    """A loss that needs no gradient. Eager: ``loss.backward()`` fails ("element 0 of
    tensors does not require grad and does not have a grad_fn"); training on would
    silently change nothing."""
    return argument_error(
        "the loss does not depend on any trainable parameter, so there is nothing to "
        "differentiate (eager PyTorch's loss.backward() fails here too: 'element 0 of "
        "tensors does not require grad'). Is the model's output detached (.detach(), "
        ".item(), torch.no_grad() in forward), or are all parameters frozen "
        "(requires_grad=False)?"
    )


def model_loss(outputs: Any) -> Any:
    """The loss a model computed itself: a tensor, ``outputs["loss"]`` or ``outputs.loss``."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "loss" in outputs:
        return outputs["loss"]
    if hasattr(outputs, "loss"):
        return outputs.loss
    raise argument_error(
        "with loss_fn=None the model must compute its own loss: return a 0-dim tensor, an "
        f"object with a .loss attribute, or a mapping with key 'loss'; got "
        f"{type(outputs).__name__}. Pass loss_fn=... to compute the loss from the outputs."
    )


def split_micro_batches(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    """Split every batch tensor into ``k`` equal micro-batches along dim 0."""
    if k == 1:
        return [(args, kwargs)]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] % k:
            raise argument_error(
                f"grad_accum_steps={k} splits every batch tensor into {k} micro-batches along "
                f"dim 0, but batch{pytree.keystr(path)} has {int(leaf.shape[0])} rows. Use a batch "
                f"size divisible by {k} (e.g. DataLoader(..., drop_last=True))."
            )
    micro = []
    for i in range(k):
        chunk = [
            x.tensor_split(k)[i] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves
        ]
        micro.append(pytree.tree_unflatten(chunk, spec))
    return micro


def standard_body(
    model: nn.Module,
    loss_fn: LossFn | None,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    options: Any,
) -> Callable[..., Any]:
    """The eager step that ``compile_step`` compiles, as eager PyTorch would write it (with
    ``precision=``: the AMP recipe): ``train_step(inputs, targets)`` with a ``loss_fn``,
    else ``train_step(*args, **kwargs)``. Its closure names ``model`` and ``opt`` and its
    parameters the batch, the names messages use; ``options`` has ``grad_accum_steps``,
    ``max_grad_norm`` and ``precision``."""
    k, max_norm, precision = options.grad_accum_steps, options.max_grad_norm, options.precision
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    trained = [model, *loss_modules(loss_fn, model)]  # a loss module's own parameters

    def step(model: nn.Module, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        # The model's gradients, not only the optimizer's: those of trainable parameters the
        # optimizer does not hold (frozen for it) live only inside the step too, instead
        # of accumulating in .grad from call to call.
        _zero_grad(trained, opt)
        losses = []
        for micro_args, micro_kwargs in split_micro_batches(args, kwargs, k):
            with precision.autocast(device_type) if precision else contextlib.nullcontext():
                if loss_fn is None:
                    outputs = _call(model, micro_args, micro_kwargs)
                    loss = checked_loss(model_loss(outputs), "the model's loss")
                else:
                    inputs, targets = micro_args
                    outputs = _call(model, (inputs,), {})
                    loss = checked_loss(loss_fn(outputs, targets), "loss_fn(outputs, targets)")
            if not loss.requires_grad:
                raise no_gradient_error()
            scaled = loss / k if k > 1 else loss
            (scaler.scale(scaled) if scaler else scaled).backward()
            losses.append(loss.detach())
        if max_norm is not None:
            if scaler:  # the recipe: clip the true gradients
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        if scaler is None:
            opt.step()
            _zero_grad(trained, opt)
            return loss
        scale = scaler._scale.clone()  # it backs off exactly when the step is skipped
        scaler.step(opt)
        scaler.update()
        _zero_grad(trained, opt)
        return loss, (scaler._scale < scale).to(torch.int64)

    if loss_fn is not None:

        def train_step(inputs: Any, targets: Any) -> Any:
            return step(model, opt, (inputs, targets), {})

        # The user's code the step runs: what loss_fn reads in Python (a closure's weight or
        # scale) is followed as jit follows a body's (core/python_reach.py).
        train_step.functacc_user_code = loss_fn  # type: ignore[attr-defined]
        return train_step

    def train_step_of_model(*args: Any, **kwargs: Any) -> Any:
        return step(model, opt, args, kwargs)

    return train_step_of_model


def _zero_grad(modules: list[nn.Module], opt: Any) -> None:
    for m in modules:
        m.zero_grad(set_to_none=True)
    for group in getattr(opt, "param_groups", ()):  # its tensors no module owns
        for p in group["params"]:
            p.grad = None


def loss_modules(loss_fn: LossFn | None, model: nn.Module) -> list[nn.Module]:
    """A loss module with tensors of its own (``nn.CrossEntropyLoss(weight=w)``'s class
    weights, a learnable loss weight): captured with the model, read on every call."""
    if not isinstance(loss_fn, nn.Module) or loss_fn is model:
        return []
    return (
        [loss_fn]
        if next(iter([*loss_fn.parameters(), *loss_fn.buffers()]), None) is not None
        else []
    )


def _call(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    if len(args) == 1 and not kwargs:
        inputs = args[0]
        if isinstance(inputs, dict):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)
    return model(*args, **kwargs)
