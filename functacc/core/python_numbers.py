"""Python's number functions in a traced step: they compute with symbols, as eager computes.

``math``'s functions, ``max`` and ``min`` of a fed number or an ``.item()`` stay symbolic
(:func:`symbolic_builtins`) instead of fixing the value at the trace. And eager's
``float(loss)`` is ``loss.item()`` (``running_loss += float(loss)``,
``correct += int((pred == y).sum())``): CPython's ``float()`` must return a real float, so
a trace could only fix the value, a data-dependent guard, an error. While a body is traced,
``float`` and ``int`` in its module are stand-ins (:data:`STAND_INS`): a tensor gives the
symbol of its value, which the step computes, replays or returns as it does ``.item()``'s;
anything else is the builtin's. For ``isinstance`` and ``issubclass`` they are the builtins,
and a symbol is an instance of the type whose value it stands for.

Example:
    >>> import torch
    >>> to_float, to_int = STAND_INS["float"], STAND_INS["int"]
    >>> to_float(torch.tensor(2.5)), to_int("7"), isinstance(3, to_int)
    (2.5, 7, True)
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import symbolic_max_min
from .python_numpy import TracedArray

__all__ = ["STAND_INS", "symbolic_builtins", "unstood"]


class _Builtin(type):
    """The stand-in's class checks as the builtin does (``isinstance(3, int)``), and a
    symbol is an instance of the number type it stands for: eager's ``loss.item()`` is a
    float (torchvision's ``assert isinstance(v, (float, int))`` after ``v = v.item()``)."""

    builtin: type
    symbols: tuple[type, ...]

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (cls.builtin, *cls.symbols))

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.builtin)


class _Float(float, metaclass=_Builtin):
    builtin, symbols = float, (torch.SymFloat,)

    def __new__(cls, x: Any = 0.0, /) -> Any:  # a SymFloat where a tensor is given
        if isinstance(x, TracedArray):  # float(np.mean(pred == y)) of a .numpy() array
            x = x.symbol()
        if isinstance(x, Tensor) and x.numel() == 1:
            return torch.sym_float(x.item())
        return torch.sym_float(x) if isinstance(x, _SYMBOLS) else float(x)


class _Int(int, metaclass=_Builtin):
    builtin, symbols = int, (torch.SymInt, torch.SymBool)  # a bool is an int

    def __new__(cls, x: Any = 0, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, TracedArray) and not args and not kwargs:
            x = x.symbol()
        if isinstance(x, Tensor) and x.numel() == 1 and not args and not kwargs:
            value = x.item()  # int() of a float truncates, as torch.sym_int does
            return torch.sym_int(value) if x.is_floating_point() else value
        if isinstance(x, _SYMBOLS) and not args and not kwargs:  # int(t.item()): no guard
            return torch.sym_int(x) if isinstance(x, torch.SymFloat) else x
        return int(x, *args, **kwargs)


STAND_INS: dict[str, type] = {"float": _Float, "int": _Int}
"""The stand-ins by the builtin's name, for a traced body's module globals."""


def unstood(value: Any) -> Any:
    """``value``, or the builtin a stand-in stands for: what the body kept of ``float``
    while traced (``defaultdict(float)``) is ``float`` after the call."""
    return value.builtin if type(value) is _Builtin else value


_ABSENT = object()
_SYMBOLS = (torch.SymInt, torch.SymFloat)


@contextlib.contextmanager
def symbolic_builtins(
    optimizer: torch.optim.Optimizer | None = None, scopes: Sequence[dict] = ()
) -> Iterator[None]:
    """While a step is traced: ``math``'s functions compute with symbols instead of fixing
    them to their value (nanoGPT's ``math.cos`` of a fed step counter in its learning-rate
    schedule, RAdam's ``math.sqrt``; of a one-element tensor, its value), and so do
    ``max``/``min`` in the optimizer's module (Adafactor's ``max(eps2, p.norm().item() /
    ...)``) and in ``scopes`` (the body's module:
    ``self.best = min(self.best, loss.item())``), and ``float``/``int`` of a tensor there
    (:data:`STAND_INS`); on plain numbers they are Python's own, so the graph computes what
    eager computes, on the host, in double. ``torch.tensor`` of such numbers is made in the
    graph."""
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: dict, name: str, value: Any) -> None:
        patched.append((owner, name, owner.get(name, _ABSENT)))
        owner[name] = value

    scopes = list(scopes)
    if optimizer is not None:
        cls = type(optimizer)
        names = {cls.__module__, getattr(cls.step, "__module__", None)}
        scopes += [vars(sys.modules[n]) for n in sorted(filter(None, names)) if n in sys.modules]
    for scope in {id(s): s for s in scopes}.values():
        for name, sym in zip(("max", "min"), symbolic_max_min(), strict=True):
            if name not in scope:  # the builtin, not the module's own
                patch(scope, name, _symbolic(getattr(builtins, name), sym))
        for name, stand_in in STAND_INS.items():  # float(loss): loss.item()
            if name not in scope:
                patch(scope, name, stand_in)
    names = ("sqrt", "cos", "sin", "tan", "acos", "asin", "atan", "cosh", "sinh", "tanh", "log2")
    for name in names:
        sym = getattr(torch, f"_sym_{name}", None)
        if sym is not None:
            patch(vars(math), name, _symbolic(getattr(math, name), sym, arity=1))
    # sgrvinod's transformer schedule: `min(math.pow(step, -0.5), step * math.pow(w, -1.5))`
    patch(vars(math), "pow", _symbolic(math.pow, _sym_pow, arity=2))
    for name in ("exp", "log"):  # no symbolic form in torch: computed in the graph, in double
        patch(vars(math), name, _symbolic(getattr(math, name), _in_graph(name), arity=1))
    for name in ("isfinite", "isnan", "isinf"):  # MAE's `if not math.isfinite(loss_value):`
        patch(vars(math), name, _symbolic(getattr(math, name), _asserted(name), arity=1))
    for name in ("tensor", "as_tensor"):  # torch.tensor(rewards) of fed numbers
        patch(vars(torch), name, _tensor_of_symbols(getattr(torch, name)))
    try:
        yield
    finally:
        for owner, name, value in reversed(patched):
            if value is _ABSENT:
                del owner[name]
            else:
                owner[name] = value


def _sym_pow(x: Any, y: Any) -> Any:
    """``math.pow`` of symbols: ``float(x) ** float(y)``, C's ``pow`` in double as
    ``math.pow`` (a negative base with a fractional exponent, ``ValueError`` in eager, is not
    checked)."""
    return torch.sym_float(x) ** torch.sym_float(y)


def _in_graph(name: str) -> Callable:
    """``math.<name>`` of a symbol as a number the graph computes (YOLOv5's EMA decay
    ``1 - math.exp(-updates / tau)`` of its fed update count), not fixed to its value."""
    op = getattr(torch, name)

    def compute(x: Any) -> Any:
        return op(torch.scalar_tensor(x, dtype=torch.float64)).item()

    return compute


def _asserted(name: str) -> Callable:
    """``math.isfinite`` (``isnan``, ``isinf``) of a number the graph computes: the loss
    check of MAE, DeiT and DINO (``if not math.isfinite(loss_value): sys.exit(1)``) takes the
    branch of a finite value, and the graph asserts that the value is one: a call where it
    is not fails before any state is written, where eager takes the other branch."""

    def check(x: Any) -> bool:
        frame = sys._getframe(2)  # the user's line, through _symbolic's call
        where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        value = torch.scalar_tensor(x, dtype=torch.float64)
        holds = torch.isfinite(value) if name == "isfinite" else ~getattr(torch, name)(value)
        torch._assert_async(
            holds,
            f"functacc: math.{name}() at {where} met a non-finite value. Eager takes the other "
            "branch there (a loss check that stops the run); functacc.jit traced the branch "
            "of a finite value, so this call failed instead, changing nothing. To run that "
            "branch, return the value and check it after the call.",
        )
        return name == "isfinite"

    return check


def _tensor_of_symbols(real: Callable) -> Callable:
    """``torch.tensor(data)`` where ``data`` (nested lists or tuples) holds numbers the graph
    takes or computes (a fed list of rewards, a discounted return summed in Python): made
    in the graph, item by item, as eager would make it from their values; torch's own
    constructor would fix each to its value at the trace (a guard per value)."""

    def tensor(data: Any, *args: Any, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
        flat, shape = _leaves(data)
        if args or not flat or not any(isinstance(v, _SYMBOLS) for v in flat):
            return real(data, *args, dtype=dtype, device=device, **kwargs)
        if dtype is None:  # as torch infers it: bools, integers, else the default float
            floats = any(isinstance(v, (float, torch.SymFloat)) for v in flat)
            bools = all(isinstance(v, (bool, torch.SymBool)) for v in flat)
            dtype = torch.bool if bools else torch.get_default_dtype() if floats else torch.int64
        made = torch.stack([torch.scalar_tensor(v, dtype=dtype, device=device) for v in flat])
        made = made.reshape(shape)
        return made.requires_grad_() if kwargs.get("requires_grad") else made

    return tensor


def _leaves(data: Any) -> tuple[list | None, tuple[int, ...]]:
    """The numbers of nested lists, tuples or deques (REINFORCE's returns), in order, and
    their shape (``None`` for anything else: a tensor, an array, ragged lists)."""
    if isinstance(data, (bool, int, float, *_SYMBOLS, torch.SymBool)):
        return [data], ()
    if not isinstance(data, (list, tuple, collections.deque)) or not data:
        return None, ()
    parts = [_leaves(item) for item in data]
    if any(flat is None for flat, _ in parts) or len({shape for _, shape in parts}) != 1:
        return None, ()
    return [v for flat, _ in parts for v in flat], (len(data), *parts[0][1])  # type: ignore[union-attr]


def _symbolic(python: Callable, sym: Callable, arity: int = 2) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        if arity == 1:  # math's: a one-element tensor is its float(), as in eager
            args = tuple(_number(a) for a in args)
        if len(args) == arity and not kwargs and any(isinstance(a, _SYMBOLS) for a in args):
            return sym(*args)
        return python(*args, **kwargs)

    return call


def _number(value: Any) -> Any:
    """A one-element tensor's value (a symbol of the graph while traced), else ``value``:
    ``math.exp(-n / 2000)`` of an EMA's update count kept in a tensor."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return torch.sym_float(value.item())
    return value
