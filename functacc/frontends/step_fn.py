"""What ``compile_step``'s standard body is made of: the argument checks, the loss checks,
micro-batches, and :class:`TrainState`, the form of the step's state for its pure call
(``step.init_state()``, ``step.apply(state, ...)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..core.diagnostics import describe_tensor
from ..core.functional import unwrap
from ..errors import argument_error

__all__ = ["LossFn", "TrainState"]

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
