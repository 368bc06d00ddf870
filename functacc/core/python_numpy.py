"""``tensor.numpy()`` in a traced step body: the array eager makes, made after each call.

Training loops collect predictions for metrics computed later (scikit-learn's F1, a
confusion matrix): ``preds.extend(out.argmax(1).cpu().numpy())``,
``labels.append(y.cpu().numpy())``. While the body is traced its tensors have no values,
and ``.numpy()`` failed. Now it gives a :class:`TracedArray`, standing for the array of a
tensor the graph returns: stored, appended, returned or iterated (``list.extend`` takes its
items, NumPy scalars as eager's), it becomes that array after each call
(:func:`numpy_template`, built by :func:`~.python_effects.build`). Computing with it in the
step (``arr == y``, ``np.mean(arr)``, ``float(arr[0])``) would need its values: a
:class:`~functacc.TraceError` saying to compute with the tensor, or after the call.

Example:
    >>> import torch
    >>> arr = TracedArray(torch.arange(3))
    >>> len(arr), arr.shape, [item.index for item in arr]
    (3, (3,), [(0,), (1,), (2,)])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..errors import TraceError

__all__ = ["TracedArray", "numpy_template", "traced_numpy"]


class TracedArray:
    """The NumPy array of traced ``tensor`` (at ``index``: an item of it)."""

    def __init__(self, tensor: Tensor, index: tuple[int, ...] = (), base: Any = None):
        self.tensor, self.index = tensor, index
        self.base = base if base is not None else self  # holds the graph output's template
        self.slot: tuple | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[len(self.index) :])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self) -> Iterator[TracedArray]:
        return (TracedArray(self.tensor, (*self.index, i), self.base) for i in range(len(self)))

    def __getitem__(self, i: Any) -> TracedArray:
        if isinstance(i, int) and self.shape and -self.shape[0] <= i < self.shape[0]:
            return TracedArray(self.tensor, (*self.index, i % self.shape[0]), self.base)
        raise _values_error(f"indexing it with {i!r}")

    def __getattr__(self, name: str) -> Any:
        raise _values_error(f".{name}")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _values_error("converting it (np.asarray, np.concatenate)")

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        raise _values_error("computing with it")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refused  # type: ignore[assignment]
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refused
    __truediv__ = __rtruediv__ = __floordiv__ = __mod__ = __pow__ = __neg__ = _refused
    __float__ = __int__ = __index__ = __bool__ = __format__ = _refused
    __hash__ = object.__hash__


def traced_numpy(real: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.numpy`` while a body is traced: a :class:`TracedArray` of a traced tensor
    (a real one, a constant, still gives its array)."""

    def numpy(self: Tensor, *, force: bool = False) -> Any:
        if type(self) is Tensor or isinstance(self, torch.nn.Parameter):
            return real(self, force=force)
        return TracedArray(self.detach())

    return numpy


def numpy_template(value: TracedArray, template: Callable[[Any], tuple]) -> tuple:
    """The template of ``value``: its tensor's output (one per array, whatever the items
    taken of it), and where in that array it is."""
    base = value.base
    if base.slot is None:
        base.slot = template(base.tensor)
    return ("numpy", base.slot, value.index)


def _values_error(what: str) -> TraceError:
    return TraceError(
        f"the step uses the NumPy array of a traced tensor ({what}): functacc.jit makes the "
        "array after each call, from the tensor the graph returns, so in the step it has no "
        "values yet. Keeping it is fine (append it to a list, extend a list with it, store "
        "or return it). Fix: compute with the tensor in the step (torch ops; .item() for a "
        "number), or with the array after the call."
    )
