"""The arrays a traced step draws from ``np.random``, and where torch takes them.

:mod:`.python_draws` feeds each array the step draws to the graph. While a trace runs, the
step gets the array as a :class:`DrawnArray`; every conversion of a NumPy array to torch
goes through ``aten.lift_fresh`` (``torch.Tensor(z)``, ``torch.from_numpy(z)``,
``torch.tensor(z)``, ``LongTensor(z)``), where :class:`Lifts` recognises the array's memory
(or a view's, or an ``astype``'s) and answers with the draw's graph input. NumPy arithmetic
on the array (its ufuncs and functions, an item, an iteration) is refused at once. NumPy
code that takes its values in C (another array indexed with it, ``y_cat[range(n), y] = 1``)
cannot be seen: such a value reaches torch as a constant of the graph. So the trace that
takes the draws as inputs gives the step other values than the trace that found them (the
same numbers, rotated), and a constant that differs between the two is refused.

Example:
    >>> import numpy as np
    >>> lifts = Lifts()
    >>> z = lifts.add(np.arange(6.0).reshape(2, 3), root=None)
    >>> type(z).__name__, lifts.span(z[:, 1:])
    ('DrawnArray', (None, 1))
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import TraceError, drawn_computed_error

__all__ = ["DrawnArray", "Lifts", "drawn_template"]


class DrawnArray(np.ndarray):
    """An array the step drew while traced: handed to torch it is the graph's input;
    computing with it in NumPy is refused (it has no values of the call)."""

    _root: Any = None  # its python_draws.DrawRoot
    _lifts: Lifts | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._root, self._lifts = getattr(obj, "_root", None), getattr(obj, "_lifts", None)
        if self._lifts is not None and self._lifts.span(self) is None:
            self._lifts.refuse(self._root, "a copy of it (astype, copy, np.array)")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise self._refused(f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}"))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise self._refused(f"np.{func.__name__}")

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        """A cast, as torch's ``.to(dtype)`` makes it: handed to torch, the draw's input cast
        in the graph (``np.random.normal(size=s).astype(np.float32)``)."""
        lifts = self._lifts
        self._lifts = None  # the copy is not refused: it is noted as a cast
        try:
            cast = super().astype(dtype, *args, **kwargs)
        finally:
            self._lifts = lifts
        if lifts is not None:
            if lifts.span(self) is None or self.size != cast.size:
                lifts.refuse(self._root, "a cast of a part of it")
            elif not _castable(self.dtype, cast.dtype):
                lifts.refuse(self._root, f"a cast to {cast.dtype}")
            else:
                lifts.casts.append((cast, self))
        return cast

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        if not isinstance(item, np.ndarray):
            raise self._refused(f"an item of it ([{index!r}])")
        return item

    def __iter__(self) -> Iterator[Any]:
        if self.ndim <= 1:
            raise self._refused("iterating over its numbers")
        return super().__iter__()

    def _scalar(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refused("a number of it")

    item = tolist = __float__ = __int__ = __index__ = __bool__ = _scalar  # type: ignore[assignment]

    def _refused(self, what: str) -> TraceError:
        return drawn_computed_error(_label(self._root), what, _hoist(self._root))


class Lifts:
    """One trace's drawn arrays, the casts made of them, and the constants torch made of
    other arrays (to compare with another trace's)."""

    def __init__(self) -> None:
        self.arrays: list[tuple[DrawnArray, Any]] = []
        self.casts: list[tuple[np.ndarray, np.ndarray]] = []
        self.constants: list[tuple[tuple, str]] = []  # (layout, digest), where made
        self.refusal: TraceError | None = None

    def add(self, value: np.ndarray, root: Any, rotate: bool = False) -> DrawnArray:
        """The step's array for a draw of ``value`` (``rotate``: its numbers moved by one
        place, for the trace that takes the draw as an input)."""
        array = (np.roll(value, 1) if rotate else value).view(DrawnArray)
        array._root, array._lifts = root, self
        if root is not None:
            root.lifts = self  # (a cast of the array holds no Lifts of its own)
        self.arrays.append((array, root))
        return array

    def span(self, array: np.ndarray) -> tuple[Any, int] | None:
        """The draw whose memory ``array`` views, with its first element's offset there."""
        start = _address(array)
        for drawn, root in self.arrays:
            if _inside(drawn, start) and array.dtype == drawn.dtype:
                return root, (start - _address(drawn)) // drawn.itemsize
        return None

    def lifted(self, real: Tensor) -> Tensor | None:
        """The graph's tensor for ``real``, a tensor torch made of a drawn array (None: of
        no draw, or of one not fed yet, whose trace is made again)."""
        start = real.data_ptr()
        for cast, of in self.casts:  # z.astype(np.float32): the draw's view, cast
            if _inside(cast, start):
                inner = self._view(of)
                same = start == _address(cast) and real.shape == cast.shape
                if inner is None or not same or real.stride() != _elements(cast):
                    raise drawn_computed_error(
                        _label(of._root), "a part of a cast of it", _hoist(of._root)
                    )
                return inner.to(_TORCH[cast.dtype])
        for drawn, root in self.arrays:
            if _inside(drawn, start):
                if root.traced is None:
                    return None
                if real.dtype != root.traced.dtype:
                    raise drawn_computed_error(root.label, f"its memory as {real.dtype}")
                offset = (start - _address(drawn)) // drawn.itemsize
                return _strided(root.traced, tuple(real.shape), real.stride(), offset)
        if self.arrays:  # another array: a constant, which may have been computed from them
            with _disable_current_modes():  # its values, read past the trace's modes
                digest = hashlib.sha1(real.numpy().tobytes()).hexdigest()
            self.constants.append(((tuple(real.shape), real.dtype, digest), _user_line()))
        return None

    def _view(self, array: np.ndarray) -> Tensor | None:
        found = self.span(array)
        if found is None or found[0].traced is None:
            return None
        return _strided(found[0].traced, array.shape, _elements(array), found[1])

    def refuse(self, root: Any, what: str) -> None:
        if self.refusal is None:
            self.refusal = drawn_computed_error(_label(root), what, _hoist(root))

    def changed_constant(self, before: Lifts) -> str | None:
        """Where this trace made a constant of another array that ``before``, a trace with
        the same draws but other values, made otherwise: computed from the draws in NumPy."""
        if len(before.constants) != len(self.constants):
            return None
        pairs = zip(before.constants, self.constants, strict=True)
        return next((where for (a, _), (b, where) in pairs if a != b), None)

    def mode(self) -> TorchDispatchMode:
        return _Lifted(self)


def drawn_template(value: DrawnArray, template: Any) -> tuple:
    """How to make ``value``, a drawn array (or a view or a cast of one) the step returns,
    stores or prints, after each call: the array of its graph input, as eager's is that
    call's draw. ``template`` makes a tensor's template (an output of the graph)."""
    lifts = value._lifts or getattr(value._root, "lifts", None)  # a cast's: its draw's
    if value._root is None or value._root.traced is None or lifts is None:
        return ("const", "<drawn>")  # a trace that found the draw: made again, not run
    cast = next((of for c, of in lifts.casts if c is value), None)
    tensor = lifts._view(cast if cast is not None else value)
    if tensor is None:
        raise drawn_computed_error(
            _label(value._root), "a copy of a part of it, kept", _hoist(value._root)
        )
    if cast is not None:
        tensor = tensor.to(_TORCH[value.dtype])
    return ("numpy", template(tensor.detach()), ())


class _Lifted(TorchDispatchMode):
    """Answers ``aten.lift_fresh`` (every conversion of a NumPy array to torch) of a drawn
    array with the draw's graph input."""

    def __init__(self, lifts: Lifts):
        super().__init__()
        self.lifts = lifts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.lift_fresh.default and type(args[0]) is Tensor:
            lifted = self.lifts.lifted(args[0])
            if lifted is not None:
                return lifted
        return func(*args, **(kwargs or {}))


def _label(root: Any) -> str:
    return root.label if root is not None else "np.random"


def _hoist(root: Any) -> str | None:
    """The call to run before the step instead (``failure_sites.step_path``), if any."""
    return getattr(root, "path", None)


def _user_line() -> str:
    """The line of the user's code that handed the array to torch."""
    from .python_output import is_user_code

    frame = sys._getframe(1)
    while frame is not None and not is_user_code(frame.f_code.co_filename):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _inside(array: np.ndarray, address: int) -> bool:
    return _address(array) <= address < _address(array) + max(array.nbytes, 1)


def _elements(array: np.ndarray) -> tuple[int, ...]:
    return tuple(s // array.itemsize for s in array.strides)


def _strided(t: Tensor, shape: tuple, stride: tuple, offset: int) -> Tensor:
    if offset == 0 and tuple(t.shape) == tuple(shape) and t.stride() == tuple(stride):
        return t
    return t.as_strided(shape, stride, offset)


# NumPy's dtypes a cast may give, as torch's (made without a tensor: tensors made while
# the trace runs would be fakes).
_TORCH = {
    np.dtype(name): getattr(torch, name)
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8")
}


def _castable(source: np.dtype, target: np.dtype) -> bool:
    """Whether NumPy's cast is torch's: between floating types, or integers to floats or to
    wider integers (no wrapping, no truncation of a float: those differ at the edges)."""
    if target not in _TORCH:
        return False
    if source.kind == "f":
        return target.kind == "f"
    return source.kind in "iu" and (target.kind == "f" or np.can_cast(source, target))
