"""``tensor.numpy()`` in a traced step body: NumPy computed in the graph, arrays made after.

Training loops collect predictions for metrics computed later (scikit-learn's F1, a
confusion matrix): ``preds.extend(out.argmax(1).cpu().numpy())``,
``labels.append(y.cpu().numpy())``, and compute metrics with NumPy in the step
(PyTorch-GAN's ACGAN: ``d_acc = np.mean(np.argmax(pred, axis=1) == gt)`` of two
``np.concatenate``-d ``.numpy()`` arrays, printed with ``%d%%``). While the body is traced
its tensors have no values, so ``.numpy()`` gives a :class:`TracedArray` standing for the
array of a traced tensor. NumPy's functions, ufuncs, operators and methods on it run in the
graph through ``torch._numpy`` (torch's implementation of NumPy's API, which
``torch.compile`` uses for the same purpose), with NumPy's dtypes (``np.mean`` of booleans
is a float64); a 0-d result is a NumPy scalar, as NumPy's reductions give. Stored,
appended, returned, printed or formatted into a string (``f"{acc:.2f}"``,
``"%d%%" % (100 * acc)``), each becomes its array or scalar after each call
(:func:`numpy_template`, built by :func:`~.python_effects.build`); ``float()`` and ``int()``
of a scalar are the symbols ``.item()`` gives. What needs the values in the step is a
:class:`~functacc.TraceError` saying so: a branch on them, a conversion to a real array
(``np.asarray``, scikit-learn), a change in place.

Integer and boolean results (counts, accuracies) are eager's exactly; a float reduction is
torch's, whose summation order may differ from NumPy's in the last bits.

Example:
    >>> import torch
    >>> arr = TracedArray(torch.arange(3))
    >>> len(arr), arr.shape, [item.index for item in arr]
    (3, (3,), [(0,), (1,), (2,)])
    >>> total = arr.sum() * 2
    >>> total.scalar, total.dtype, total.tensor
    (True, dtype('int64'), tensor(6))
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import TraceError

__all__ = [
    "NUMBERS",
    "TracedArray",
    "new_number",
    "numpy_template",
    "symbol_ufunc",
    "traced_numpy",
]

NUMBERS = (int, float, np.int64)
"""The numbers a step's counter may hold, fed to the graph once they change: Python's, and
NumPy's int64 (``correct += np.sum(pred == y)``; a float64 is a float), whose arithmetic is
int's."""


class TracedArray:
    """The NumPy array of traced ``tensor`` (at ``index``: an item of it); ``scalar``: a
    NumPy scalar (``np.float64``), as NumPy's reductions return."""

    def __init__(self, tensor: Tensor, index: tuple[int, ...] = (), base: Any = None, *,
                 scalar: bool = False):  # fmt: skip
        self.tensor, self.index, self.scalar = tensor, index, scalar
        self.base = base if base is not None else self  # holds the graph output's template
        self.slot: tuple | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[len(self.index) :])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(str(self.tensor.dtype).removeprefix("torch."))

    def value(self) -> Tensor:
        """The tensor of this array (of this item)."""
        return self.tensor[self.index] if self.index else self.tensor

    def symbol(self) -> Any:
        """The Python number of a one-element array: ``.item()``'s symbol, one per array
        (Inductor merges two reads of one value and loses the second's symbol)."""
        if self.__dict__.get("_symbol") is None:
            value = self.value()
            if value.numel() != 1:
                raise _values_error("converting it to one number (it has more than one element)")
            self._symbol = (value if value.dim() == 0 else value.reshape(())).item()
        return self._symbol

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self) -> Iterator[TracedArray]:
        return (TracedArray(self.tensor, (*self.index, i), self.base) for i in range(len(self)))

    def __getitem__(self, i: Any) -> TracedArray:
        if isinstance(i, int) and self.shape and -self.shape[0] <= i < self.shape[0]:
            return TracedArray(self.tensor, (*self.index, i % self.shape[0]), self.base)
        return _compute(f"indexing it with {i!r}", operator.getitem, (self, i), {})

    def __setitem__(self, i: Any, value: Any) -> None:
        raise _values_error("changing it in place")

    def __getattr__(self, name: str) -> Any:
        import torch._numpy as tnp

        if name.startswith("__"):  # NumPy's protocols (__array_struct__): not an array
            raise AttributeError(name)
        if name == "item":  # a Python number: the symbol .item() gives
            return self.symbol
        if name == "tolist":  # Python numbers, the symbols of the tensor's tolist()
            return self.value().tolist
        if name == "device":  # NumPy 2's (array-API libraries ask before converting)
            return "cpu"
        if not hasattr(np.ndarray, name):
            raise AttributeError(f"'numpy.ndarray' object has no attribute '{name}'")
        attribute = getattr(tnp.ndarray, name, None)
        if attribute is None or name == "tensor":
            raise _values_error(f".{name}, which torch._numpy does not compute")
        if callable(attribute):
            return lambda *args, **kwargs: _compute(f".{name}()", attribute, (self, *args), kwargs)
        return _compute(f".{name}", getattr, (self, name), {})

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _values_error("converting it to a real array (np.asarray, np.array, a library)")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        import torch._numpy as tnp

        what = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        function = getattr(tnp, ufunc.__name__, None)
        if "out" in kwargs:  # acc += np.bincount(arr): into host data
            raise _values_error(f"{what} writing into a NumPy array (out=, +=)")
        if method != "__call__" or function is None:
            raise _values_error(f"{what}, which torch._numpy does not compute")
        return _compute(what, function, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        import torch._numpy as tnp

        function: Any = tnp
        for part in [*func.__module__.split(".")[1:], func.__name__]:
            function = getattr(function, part, None)
        if function is None:
            raise _values_error(f"np.{func.__name__}, which torch._numpy does not compute")
        return _compute(f"np.{func.__name__}", function, args, kwargs)

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        raise _values_error("converting it to a Python value")

    # float()/int() in the body's module are stand-ins (python_numbers), '%' conversions
    # are patched while traced (python_percent), formatting too (python_output).
    __float__ = __int__ = __format__ = __str__ = _refused
    __hash__ = object.__hash__

    def __bool__(self) -> bool:  # a branch on the values: the trace's data-dependent error
        return bool(self.symbol())


def _operator(function: Callable[..., Any], reflected: bool = False) -> Callable[..., Any]:
    def apply(self: TracedArray, *other: Any) -> Any:
        operands = (*other, self) if reflected else (self, *other)
        return _compute(f"the operator {function.__name__}", function, operands, {})

    return apply


def _in_place(function: Callable[..., Any]) -> Callable[..., Any]:
    def apply(self: TracedArray, other: Any) -> Any:  # a NumPy scalar is immutable
        if not self.scalar:
            raise _values_error(f"changing it in place ({function.__name__})")
        return _compute(f"the operator {function.__name__}", function, (self, other), {})

    return apply


_BINARY = {name: getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "xor", "lshift", "rshift"
)} | {"and": operator.and_, "or": operator.or_}  # fmt: skip
for _name, _function in _BINARY.items():
    setattr(TracedArray, f"__{_name}__", _operator(_function))
    setattr(TracedArray, f"__r{_name}__", _operator(_function, reflected=True))
    setattr(TracedArray, f"__i{_name}__", _in_place(_function))
for _name in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "abs", "invert"):
    setattr(TracedArray, f"__{_name}__", _operator(getattr(operator, _name)))


def _compute(what: str, function: Callable[..., Any], args: Any, kwargs: dict) -> Any:
    """``function`` of torch._numpy on ``args`` with the traced arrays' tensors: the result's
    arrays traced arrays."""
    try:
        result = function(*_into(args), **_into(kwargs))
    except TraceError:
        raise
    except Exception as exc:
        raise _values_error(f"{what}, which torch._numpy could not compute ({exc})") from exc
    return _out_of(result)


def _into(value: Any) -> Any:
    """``value`` for torch._numpy: traced arrays as its arrays, NumPy's dtypes by name."""
    import torch._numpy as tnp

    if isinstance(value, TracedArray):
        return tnp.asarray(value.value())
    if isinstance(value, (list, tuple)):
        return type(value)(_into(v) for v in value)
    if isinstance(value, dict):
        return {k: _into(v) for k, v in value.items()}
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return np.dtype(value).name
    if isinstance(value, (np.ndarray, np.generic)):  # a constant of the step
        return tnp.asarray(torch.from_numpy(np.array(value)))
    return value


def _out_of(value: Any) -> Any:
    import torch._numpy as tnp

    if isinstance(value, tnp.ndarray):
        return TracedArray(value.tensor, scalar=value.ndim == 0)
    if isinstance(value, (list, tuple)):
        return type(value)(_out_of(v) for v in value)
    if isinstance(value, tnp.DType):
        return np.dtype(value.name)
    return value


def new_number(value: Any) -> bool:
    """Whether a counter's new value is a number: a Python or NumPy one, its symbol, or a
    NumPy scalar the graph computes (``correct += np.sum(hit)``)."""
    if isinstance(value, TracedArray):
        return value.scalar
    return isinstance(value, (*NUMBERS, torch.SymInt, torch.SymFloat))


def traced_numpy(real: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.numpy`` while a body is traced: a :class:`TracedArray` of a traced tensor
    (a real one, a constant, still gives its array)."""

    def numpy(self: Tensor, *, force: bool = False) -> Any:
        if type(self) is Tensor or isinstance(self, torch.nn.Parameter):
            return real(self, force=force)
        return TracedArray(self.detach())

    return numpy


def symbol_ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
    """``__array_ufunc__`` of a Python number's symbol while traced (improved-diffusion's
    ``np.sqrt(sqsum)`` of a sum of ``.item()`` s): NumPy takes the number as a 0-d array of
    float64 (int64, bool), as it takes a Python number, so the result is the NumPy scalar
    eager's ufunc gives, computed in the graph."""
    kinds = {torch.SymFloat: torch.float64, torch.SymInt: torch.int64, torch.SymBool: torch.bool}

    def as_array(x: Any) -> Any:
        kind = kinds.get(type(x))
        return x if kind is None else TracedArray(torch.scalar_tensor(x, dtype=kind), scalar=True)

    arrays = [as_array(x) for x in inputs]
    first = next(x for x in arrays if isinstance(x, TracedArray))
    return first.__array_ufunc__(ufunc, method, *arrays, **kwargs)


def numpy_template(value: TracedArray, template: Callable[[Any], tuple]) -> tuple:
    """The template of ``value``: its tensor's output (one per array, whatever the items
    taken of it), where in that array it is, and whether it is a NumPy scalar."""
    base = value.base
    if base.slot is None:
        base.slot = template(base.tensor)
    return ("numpy", base.slot, value.index, value.scalar)


def _values_error(what: str) -> TraceError:
    return TraceError(
        f"the step uses the NumPy array of a traced tensor ({what}): functacc.jit computes "
        "NumPy's functions and operators on it in the graph and makes the array after each "
        "call, from the tensor the graph returns, so in the step it has no values yet. "
        "Keeping it is fine (append, store, return or print it), and so is formatting it "
        "into a string. Fix: compute with the tensor in the step (torch ops; .item() for a "
        "number), or with the array after the call; a library's metric in a function of "
        "yours wrapped with functacc.host, which runs after each call with the call's arrays "
        "(@functacc.host def log_acc(y, p): accs.append(accuracy_score(y, p)))."
    )
