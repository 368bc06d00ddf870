"""``p.data = value`` in a traced step: written into ``p``.

Older training code clips or projects its weights by assigning ``.data``
(``for p in critic.parameters(): p.data = p.data.clamp(-c, c)``). Traced as it is, the
assignment swapped the traced tensor's data outside the graph's view and the graph never wrote
the new values back: the weights went unclipped, silently. While a step body is traced, an
assignment of a value of the tensor's own shape, dtype and device is ``p.data.copy_(value)``,
which the graph writes as eager's assignment leaves it (``.data`` keeps autograd out, as
eager's does); another shape or dtype is a :class:`~functacc.errors.TraceError`.

So is a module's conversion in the step (``model.to(...)``, ``.cpu()``, ``.half()``) that
would change its tensors; one that changes nothing (pytorch/examples' fast_neural_style
saves a checkpoint in its loop between ``transformer.eval().cpu()`` and
``transformer.to(device).train()``, on a CPU model) leaves the module as it is, as eager's
does: before 2026-11-30 it failed ("_apply(): Couldn't swap Conv2d.weight").

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> with data_assignments_written():
    ...     p.data = p.data * 2
    >>> p.data
    tensor([2., 2.])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import TraceError

__all__ = ["data_assignments_written"]

_DATA = torch._C.TensorBase.__dict__["data"]


@contextlib.contextmanager
def data_assignments_written() -> Iterator[None]:
    """While inside: ``tensor.data = value`` copies ``value`` into the tensor's data, and a
    module's conversion that keeps every tensor is left undone (others: refused)."""

    def get(self: torch.Tensor) -> torch.Tensor:
        return _DATA.__get__(self)

    def set_(self: torch.Tensor, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            _DATA.__set__(self, value)  # torch's own error
            return
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            raise TraceError(
                f"the step assigns .data of a {tuple(self.shape)} {self.dtype} tensor a "
                f"{tuple(value.shape)} {value.dtype} tensor: a traced step writes a tensor's "
                "new values into it, in its own shape and dtype. Fix: keep the shape and dtype "
                "(p.data = value.to(p.dtype).reshape(p.shape)), or replace the parameter "
                "outside the step."
            )
        _DATA.__get__(self).copy_(value)

    real_apply = nn.Module._apply

    def apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        modules = self.modules() if recurse else [self]
        held = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values())]
        with torch.no_grad():
            if all(fn(t) is t for t in held if t is not None):
                return self  # eager's conversion keeps every tensor too
        raise TraceError(
            f"the step converts a {type(self).__name__} (.to(), .cpu(), .half(), ...) to other "
            "tensors while functacc.jit traces it; its parameters and buffers are the step's "
            "inputs, in the dtype and on the device they had at the call. Fix: convert the "
            "model before the call (and build the step again after converting it), or after."
        )

    torch.Tensor.data = property(get, set_)  # type: ignore[assignment]
    nn.Module._apply = apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        del torch.Tensor.data
        nn.Module._apply = real_apply  # type: ignore[method-assign]
