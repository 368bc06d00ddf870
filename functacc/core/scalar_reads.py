"""The number a one-element tensor of the step's state holds, read with ``.item()``.

Eager code reads such numbers and branches on them: an optimizer's step count
(``state["step"]``), lucidrains' ``ema_pytorch`` (``step = self.step.item()``, then
``if step % self.update_every != 0: return`` and ``if not self.initted.item():``), Glow's
``ActNorm`` (``if self.initialized.item() == 0: self.initialize(x)``). A trace cannot
branch on a tensor's value, so such a tensor (:class:`ScalarOf`) is read on the host
before each call and fed to the graph as a number once a trace branched on it: the branch
becomes a guard on that number (a call whose number takes the other branch traces again)
and the graph stays one graph per branch taken, not per value.

:class:`ScalarReads` gives the traced code that number: ``.item()`` (and ``float()``,
``int()``, ``bool()``) of a fed tensor is its fed symbol, followed through whole-number
increments (``self.step += 1``); any other write stops that (a later ``.item()`` is a
symbol without a value again, as a write through a view or ``.data`` is).

Example:
    >>> import torch
    >>> from functacc.core.python_location import Location, Root
    >>> count = torch.tensor(3)
    >>> scalar = ScalarOf(Location(Root("ema.step", lambda: count, None)))
    >>> scalar.label, scalar.get()
    ('ema.step.item()', 3)
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from .python_location import Location, Root

__all__ = ["ScalarOf", "ScalarReads", "buffer_reads"]


class ScalarOf:
    """The number a one-element tensor holds, as a source of a fed value: read on the
    host before each call (a device sync where the tensor is on a GPU, as eager's
    ``.item()`` is). A bool is fed as 0 or 1 (fed numbers are ints and floats)."""

    def __init__(self, location: Location, siblings: Callable[[], list[ScalarOf]] | None = None):
        self.location = location
        self.label = f"{location.label}.item()"
        self._siblings = siblings

    @property
    def siblings(self) -> list[ScalarOf]:
        """Those fed together with it: the same entry of every parameter's state."""
        return self._siblings() if self._siblings is not None else [self]

    def get(self) -> Any:
        value = self.location.get()
        value = value.item() if isinstance(value, Tensor) else value
        return int(value) if isinstance(value, bool) else value

    def set(self, value: Any) -> None:
        """Nothing to install: the traced step reads the number through ``.item()``."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScalarOf) and self.location == other.location

    def __hash__(self) -> int:
        return hash(("item", self.location))

    def __repr__(self) -> str:
        return f"ScalarOf({self.label})"


class ScalarReads(torch.overrides.TorchFunctionMode):
    """While a step is traced: the Python number a state tensor of ``sources`` holds.

    ``.item()`` of a source that is not fed gives a symbol without a value; each is noted
    (``symbols``), so that a branch on it makes it fed at the next trace. A fed one starts
    as its fed number (``fed``, by the tensor's ``id``) and follows whole-number increments
    (``step_t += 1``, exact in float32 up to 2**24)."""

    def __init__(self, sources: dict[int, ScalarOf], fed: dict[int, Any], symbols: dict):
        super().__init__()
        self.sources, self.values, self.symbols = sources, dict(fed), symbols
        self.tensors: dict[int, Tensor] = {}  # kept alive while their ids are keys
        self.versions: dict[int, int] = {}  # a known number's tensor: checked on reads
        # Tensors computed from a source whose number is not known (self.calls > 2): a
        # branch on one feeds that source next time.
        self.origins: dict[int, ScalarOf] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func in _FROM_NUMBER and isinstance(target, (torch.SymFloat, torch.SymInt)):
            # torch.as_tensor(lr / ...) of a fed number: traced as that number's tensor
            # (torch.tensor would fix it to its value at the trace)
            floating = isinstance(target, torch.SymFloat)
            dtype = kwargs.get("dtype") or (torch.get_default_dtype() if floating else torch.int64)
            return torch.scalar_tensor(target, dtype=dtype, device=kwargs.get("device"))
        key = id(target)
        if key not in self.sources and key not in self.values and key not in self.origins:
            return func(*args, **kwargs)
        if func in _READS:
            return _READS[func](self._read(target))
        result = func(*args, **kwargs)
        if func is _DATA and key in self.sources:  # the same number through another tensor
            self.sources[id(result)] = self.sources[key]
            self.tensors[id(result)] = result
        elif func in _ADDS and key in self.values and _whole(_other(args, kwargs)):
            alpha = kwargs.get("alpha", 1)
            if _whole(alpha):
                self.values[key] = self.values[key] + _other(args, kwargs) * alpha
                self.versions[key] = target._version
            else:
                del self.values[key]
        elif func in _WRITES or getattr(func, "__name__", "").endswith("_"):
            self._forget(target)  # a write it cannot follow (also through .data)
        elif func in _ARITHMETIC and isinstance(result, Tensor) and result.numel() == 1:
            # (self.step - after - 1).clamp(min=0.): the number, exact while whole
            op, names = _ARITHMETIC[func]
            value = op(self._whole_value(target), *_operands(self, names, args, kwargs))
            self.tensors[id(result)] = result
            if value is not None:
                self.values[id(result)] = value
            elif (origin := self.sources.get(key) or self.origins.get(key)) is not None:
                self.origins[id(result)] = origin
        return result

    def _read(self, target: Tensor) -> Any:
        """What ``.item()`` of ``target`` gives: its number where known, else a symbol
        without a value (noted, for a source: a branch on it feeds it next time)."""
        value = self._value(target)
        if value is None:
            value = Tensor.item(target)
            source = self.sources.get(id(target)) or self.origins.get(id(target))
            for symbol in value.node.expr.free_symbols if hasattr(value, "node") else ():
                if source is not None:
                    self.symbols[symbol] = source  # a bool's: Eq(u0, 1)'s u0
            return value
        if target.dtype == torch.bool:
            return value if isinstance(value, (bool, torch.SymBool)) else value != 0
        if target.dtype.is_floating_point and not isinstance(value, (float, torch.SymFloat)):
            return torch.sym_float(value)
        return value

    def _whole_value(self, t: Any) -> Any:
        if isinstance(t, Tensor):
            t = self._value(t) if t.dtype != torch.bool else None
        return t if isinstance(t, (int, torch.SymInt)) and not isinstance(t, bool) else None

    def _value(self, target: Tensor) -> Any:
        """The fed number ``target`` holds, or None where a write it cannot follow (a
        view's, in place) changed it since."""
        key = id(target)
        if key not in self.values:
            return None
        version = self.versions.setdefault(key, target._version)
        if target._version != version:
            del self.values[key]
            return None
        return self.values[key]

    def _forget(self, target: Tensor) -> None:
        self.values.pop(id(target), None)
        source = self.sources.get(id(target))
        for key, s in self.sources.items():
            if s == source:
                self.values.pop(key, None)


# float(t), int(t) and bool(t) must give real numbers: they fix the value (a guard).
_READS: dict[Any, Callable[[Any], Any]] = {
    Tensor.item: lambda v: v,
    Tensor.__float__: float,
    Tensor.__int__: int,
    Tensor.__bool__: bool,
}


_NOT_WHOLE = object()


def _whole_op(op: Callable[..., Any]) -> Callable[..., Any]:
    def whole(*values: Any) -> Any:
        return None if any(v is None or v is _NOT_WHOLE for v in values) else op(*values)

    return whole


def _clamp(value: Any, low: Any = None, high: Any = None) -> Any:
    if value is None or low is _NOT_WHOLE or high is _NOT_WHOLE:
        return None
    value = value if low is None else torch.sym_max(value, low)
    return value if high is None else torch.sym_min(value, high)


def _ops(funcs: list[Any], op: Callable[..., Any], names: tuple[str, ...]) -> dict:
    return dict.fromkeys(funcs, (op, names))


# Arithmetic whose number is known from its operands': (the op, the operands' names).
_ARITHMETIC: dict[Any, tuple[Callable[..., Any], tuple[str, ...]]] = {
    **_ops([Tensor.__add__, Tensor.__radd__, Tensor.add, torch.add], operator.add, ("other",)),
    **_ops([Tensor.__sub__, Tensor.sub, torch.sub], operator.sub, ("other",)),
    **_ops([Tensor.__rsub__], lambda a, b: b - a, ("other",)),
    **_ops([Tensor.__mul__, Tensor.__rmul__, Tensor.mul, torch.mul], operator.mul, ("other",)),
    **_ops([Tensor.__mod__, Tensor.remainder, torch.remainder], operator.mod, ("other",)),
    **_ops([Tensor.__neg__, Tensor.neg, torch.neg], operator.neg, ()),
}
for name in ("lt", "le", "gt", "ge", "eq", "ne"):  # self.calls > 2: a bool
    _ARITHMETIC |= _ops(
        [getattr(Tensor, f"__{name}__"), getattr(Tensor, name), getattr(torch, name)],
        getattr(operator, name),
        ("other",),
    )
_ARITHMETIC = {k: (_whole_op(op), names) for k, (op, names) in _ARITHMETIC.items()}
_ARITHMETIC |= {
    **_ops([Tensor.clamp, torch.clamp], _clamp, ("min", "max")),
    **_ops([Tensor.clamp_min, torch.clamp_min], _clamp, ("min",)),
    **_ops([Tensor.clamp_max, torch.clamp_max], lambda v, high: _clamp(v, None, high), ("max",)),
}
_DATA = Tensor.data.__get__
_FROM_NUMBER = {torch.as_tensor, torch.tensor}
_ADDS = {Tensor.add_, Tensor.__iadd__}
_WRITES = {Tensor.copy_, Tensor.fill_, Tensor.zero_, Tensor.__isub__, Tensor.__imul__}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _other(args: Any, kwargs: dict) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("other")


def _operands(reads: ScalarReads, names: tuple[str, ...], args: Any, kwargs: dict) -> list:
    """The other operands of an arithmetic op (``names``), each a whole number, None where
    not given, or ``_NOT_WHOLE`` (a float that is whole counts: ``clamp(min=0.)``)."""
    if kwargs.get("alpha", 1) != 1:
        return [_NOT_WHOLE]
    out = []
    for i, name in enumerate(names):
        v = args[1 + i] if len(args) > 1 + i else kwargs.get(name)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        out.append(None if v is None else _NOT_WHOLE if (w := reads._whole_value(v)) is None else w)
    return out


# A module's buffers, by step: one ScalarOf each, the same across traces (a fed location).
_BUFFERS: weakref.WeakKeyDictionary[Any, dict[str, ScalarOf]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def buffer_reads(
    owner: Any, buffers: Mapping[str, Tensor], traced: Mapping[str, Tensor], recorder: Any
) -> Iterator[None]:
    """While a body is traced: ``.item()`` of the modules' one-element buffers
    (``buffers``, by name; ``traced``: the tensors standing for them) as :class:`ScalarReads`
    gives it. ``owner``: what keeps the buffers' :class:`ScalarOf` across traces."""
    if not getattr(recorder, "item_reads", False):  # not asked for (python_state.retry)
        yield
        return
    scalars = _BUFFERS.setdefault(owner, {})
    sources, fed = {}, {}
    for n, b in buffers.items():
        if b.numel() != 1 or n not in traced:
            continue
        if n not in scalars:
            scalars[n] = ScalarOf(Location(Root(n, lambda n=n: buffers[n], None)))
        sources[id(traced[n])] = scalars[n]
        value = recorder.symbolic_inputs.get(scalars[n]) if recorder is not None else None
        if value is not None:
            fed[id(traced[n])] = value
            recorder.symbols[value.node.expr] = scalars[n]
    if not sources:
        yield
        return
    with ScalarReads(sources, fed, recorder.symbols):
        yield
