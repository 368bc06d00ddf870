"""``p.data = value`` in a traced step: written into ``p``.

Older training code clips or projects its weights by assigning ``.data``
(``for p in critic.parameters(): p.data = p.data.clamp(-c, c)``). Traced as it is, the
assignment swapped the traced tensor's data outside the graph's view and the graph never wrote
the new values back: the weights went unclipped, silently. While a step body is traced, an
assignment of a value of the tensor's own shape, dtype and device is ``p.data.copy_(value)``,
which the graph writes as eager's assignment leaves it (``.data`` keeps autograd out, as
eager's does); another shape or dtype is a :class:`~functacc.errors.TraceError`.

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

from ..errors import TraceError

__all__ = ["data_assignments_written"]

_DATA = torch._C.TensorBase.__dict__["data"]


@contextlib.contextmanager
def data_assignments_written() -> Iterator[None]:
    """While inside: ``tensor.data = value`` copies ``value`` into the tensor's data."""

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

    torch.Tensor.data = property(get, set_)  # type: ignore[assignment]
    try:
        yield
    finally:
        del torch.Tensor.data
