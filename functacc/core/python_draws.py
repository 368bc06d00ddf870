"""Draws from NumPy's and Python's global generators in a jitted step, drawn again before
every call.

PyTorch-GAN's scripts draw their noise with NumPy in the step,
``z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))``; mixup
its weight, ``lam = np.random.beta(alpha, alpha)``. A trace runs the body's Python once,
so what it drew would be a constant of the graph, every call training on the same noise.
While a body is traced, the module functions of ``np.random`` (``normal``, ``randint``,
``beta``, ...) and of ``random`` (``random``, ``uniform``, ``gauss``, ...), called with plain
arguments (numbers, shapes), stand for a graph input each (:class:`DrawRoot`, a fed
location): a number is its symbol; an array is a :class:`DrawnArray` that, handed to torch
as it is (``torch.Tensor(z)``, ``torch.from_numpy(z)``, ``torch.tensor(z)``, a view, an
``astype``), is that input. Before each call the plan draws them for real, in the trace's
order, from the same generators: eager's numbers, and the generators left where eager
leaves them. What a trace cannot follow is a :class:`~functacc.TraceError`: computing with
the array in NumPy first (``z * 2``, ``z[0]``, ``z.mean()``), or a Python branch on a drawn
number (``if random.random() < p:``), which the trace would take once for every call.

Example:
    >>> import numpy as np
    >>> root = DrawRoot(0, "np.random", "normal", (0, 1, (2, 3)), {}, np.zeros((2, 3)))
    >>> root.label, tuple(root.get().shape)
    ('np.random.normal(0, 1, (2, 3)) (draw 1)', (2, 3))
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..errors import TraceError, drawn_branch_error, drawn_computed_error
from .python_location import Location, Root

__all__ = ["DrawRoot", "DrawnArray", "HostDraws", "draw_all"]


class DrawRoot(Root):
    """The ``index``-th draw of a trace: ``<module>.<name>(*args, **kwargs)``. Read between
    calls (a signature's key), it is a value of the draw's kind (an array's layout, a
    number's type); the plan draws it for real before each call (:func:`draw_all`)."""

    def __init__(self, index: int, module: str, name: str, args: tuple, kwargs: dict, value: Any):
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        label = f"{module}.{name}({', '.join(shown)}) (draw {index + 1})"
        super().__init__(label, self._spec, self._install)
        self.index, self.module, self.name = index, module, name
        self.args, self.kwargs = args, kwargs
        self.traced: Any = None  # its graph input (a number's symbol) while a trace runs
        if isinstance(value, np.ndarray):
            with _disable_current_modes():  # made while tracing: a real tensor, not a fake
                self._layout: Any = torch.from_numpy(np.array(value))  # drawn once: its layout
        else:
            self._layout = _number(value)

    def _spec(self) -> Tensor:
        return self._layout

    def _install(self, value: Any) -> None:
        traced = isinstance(value, (Tensor, *_SYMBOLS)) and value is not self._layout
        self.traced = value if traced else None

    def draw(self) -> Any:
        """This call's value, drawn from the global generator as eager would."""
        value = getattr(_GENERATORS[self.module][0](), self.name)(*self.args, **self.kwargs)
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else _number(value)


def draw_all(roots: list[DrawRoot]) -> dict[DrawRoot, Any]:
    """One call's draws, in the order its trace made them."""
    return {root: root.draw() for root in sorted(roots, key=lambda r: r.index)}


class DrawnArray(np.ndarray):
    """An array ``np.random`` drew while a body was traced: handed to torch it is the
    graph's input; computing with it in NumPy is refused (it has no values of the call)."""

    _root: DrawRoot | None = None
    _draws: HostDraws | None = None

    def __array_finalize__(self, obj: Any) -> None:
        root, draws = getattr(obj, "_root", None), getattr(obj, "_draws", None)
        self._root, self._draws = root, draws
        if draws is not None and root is not None and draws.span(self) is None:
            draws.refuse(root, "a copy of it (astype, copy, np.array)")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise self._refused(f"np.{ufunc.__name__}")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise self._refused(f"np.{func.__name__}")

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        """A cast, as torch's ``.to(dtype)`` makes it: handed to torch, the draw's input cast
        in the graph (``np.random.normal(size=s).astype(np.float32)``)."""
        draws, root = self._draws, self._root
        self._draws = None  # the copy is not refused: it is noted as a cast
        try:
            cast = super().astype(dtype, *args, **kwargs)
        finally:
            self._draws = draws
        if draws is not None and root is not None:
            if draws.span(self) is None or self.size != cast.size:
                draws.refuse(root, "a cast of a part of it")
            elif not _castable(self.dtype, cast.dtype):
                draws.refuse(root, f"a cast to {cast.dtype}")
            else:
                draws.cast(cast, self)
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
        where = self._root.label if self._root is not None else "np.random"
        return drawn_computed_error(where, what)


def branched_on_draws(
    branches: str, inputs: dict, fed: list[Location], drawn: list[Location], sites: Any
) -> None:
    """Refuses a trace that branched on a drawn number (``branches``: its condition over
    ``t0, t1, ...``, the fed numbers in ``fed``'s order; ``inputs``: their symbols)."""
    if not drawn:
        return
    numbers = [loc for loc in fed if not isinstance(inputs[loc], Tensor)]
    # Every float input's guard says it is not NaN; a drawn one is not.
    branches = re.sub(r"not math\.isnan\(L\['t\d+'\]\)", "", branches)
    used = {numbers[int(i)] for i in re.findall(r"L\['t(\d+)'\]", branches)}
    hit = [loc for loc in drawn if loc in used]
    if hit:
        at = f" at {', '.join(sites[:3])}" if sites else ""
        raise drawn_branch_error(hit[0].root.module, f"{hit[0].label}{at}")


class HostDraws:
    """The draws of one jitted body, across its traces (each a :class:`DrawRoot`)."""

    def __init__(self) -> None:
        self._roots: dict[tuple, DrawRoot] = {}
        self.new: list[Location] = []  # draws the last trace found that were not fed
        self.made: list[DrawRoot] = []  # the last trace's draws, in order
        self._arrays: list[tuple[DrawnArray, DrawRoot]] = []
        self._refusal: TraceError | None = None
        self._casts: list[tuple[np.ndarray, np.ndarray]] = []

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """While a body is traced: ``np.random``'s functions, called by the tracing thread
        with plain arguments, give :class:`DrawnArray`; handed to torch, each is its fed
        input (or, not fed yet, a draw found: :attr:`new`)."""
        self.new, self.made, self._arrays, self._refusal = [], [], [], None
        self._casts: list[tuple[np.ndarray, np.ndarray]] = []
        tracer = threading.get_ident()
        patched = []
        for module, (get, names) in _GENERATORS.items():
            for name in names:
                current = getattr(get(), name, None)
                if callable(current):
                    patched.append((get(), name, current))
                    setattr(get(), name, self._drawing(module, name, current, tracer))
        try:
            with _Lifted(self):
                yield
            if self._refusal is not None:
                raise self._refusal
            if self.new:  # found by this trace: the next one takes them as inputs
                from .python_trace import Retry

                raise Retry(self.new)
        finally:
            for owner, name, current in patched:
                setattr(owner, name, current)
            for root in self._roots.values():
                root.traced = None
            self._arrays, self._casts = [], []

    def _drawing(self, module: str, name: str, current: Any, tracer: int) -> Any:
        original = getattr(current, "__wrapped__", current)  # under HostRandomWatch's note

        @functools.wraps(original)
        def draw(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != tracer:
                return current(*args, **kwargs)
            plain = _plain((args, kwargs))
            if plain is None and _symbolic((args, kwargs)):  # a size kept symbolic (x.shape[0])
                from .tracer import _MixedGuard

                raise _MixedGuard(f"{module}.{name} drew with a symbolic size: sizes fixed")
            if plain is None:
                return current(*args, **kwargs)
            with _kept_state():  # the plan draws it before each call; the trace does not
                value = original(*args, **kwargs)
            if not isinstance(value, np.ndarray) and _number(value) is None:
                return current(*args, **kwargs)  # random.choice(names): as before, an error
            root = self._root(len(self.made), module, name, *plain, value)
            self.made.append(root)
            if root.traced is None:
                self.new.append(Location(root))
            if not isinstance(value, np.ndarray):  # its symbol (this trace's value: redone)
                return value if root.traced is None else root.traced
            array = value.view(DrawnArray)
            array._root, array._draws = root, self
            self._arrays.append((array, root))
            return array

        return draw

    def _root(self, index: int, *call: Any) -> DrawRoot:
        module, name, args, kwargs, value = call
        kind = "array" if isinstance(value, np.ndarray) else type(_number(value)).__name__
        key = (index, module, name, repr(args), repr(sorted(kwargs.items())), kind)
        if key not in self._roots:
            self._roots[key] = DrawRoot(index, *call)
        return self._roots[key]

    def span(self, array: np.ndarray) -> tuple[DrawRoot, int] | None:
        """The draw whose memory ``array`` views, with its first element's offset there."""
        start = _address(array)
        for drawn, root in self._arrays:
            if _inside(drawn, start) and array.dtype == drawn.dtype:
                return root, (start - _address(drawn)) // drawn.itemsize
        return None

    def lifted(self, real: Tensor) -> Tensor | None:
        """The graph's tensor for ``real``, a tensor torch made of a drawn array (None: of
        no draw, or of one not fed yet, whose trace is made again)."""
        start = real.data_ptr()
        for cast, of in self._casts:  # z.astype(np.float32): the draw's view, cast
            if _inside(cast, start):
                inner = self._view(of)
                same = start == _address(cast) and real.shape == cast.shape
                if inner is None or not same or real.stride() != _elements(cast):
                    raise drawn_computed_error(self._owner(of), "a part of a cast of it")
                return inner.to(_TORCH[cast.dtype])
        for drawn, root in self._arrays:
            if _inside(drawn, start):
                if root.traced is None:
                    return None
                if real.dtype != root.traced.dtype:
                    raise drawn_computed_error(root.label, f"its memory as {real.dtype}")
                offset = (start - _address(drawn)) // drawn.itemsize
                return _strided(root.traced, tuple(real.shape), real.stride(), offset)
        return None

    def _view(self, array: np.ndarray) -> Tensor | None:
        """The graph's tensor for ``array``, a drawn array or a view of one."""
        found = self.span(array)
        if found is None or found[0].traced is None:
            return None
        return _strided(found[0].traced, array.shape, _elements(array), found[1])

    def _owner(self, array: np.ndarray) -> str:
        found = self.span(array)
        return found[0].label if found is not None else "np.random"

    def cast(self, cast: np.ndarray, of: np.ndarray) -> None:
        """``cast`` is ``of``, a drawn array or a view of one, cast to another dtype."""
        self._casts.append((cast, of))

    def refuse(self, root: DrawRoot, what: str) -> None:
        if self._refusal is None:
            self._refusal = drawn_computed_error(root.label, what)


class _Lifted(TorchDispatchMode):
    """Turns torch's tensor of a drawn array (``aten.lift_fresh``, which every conversion
    of a NumPy array goes through) into the draw's graph input."""

    def __init__(self, draws: HostDraws):
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.lift_fresh.default and type(args[0]) is Tensor:
            lifted = self.draws.lifted(args[0])
            if lifted is not None:
                return lifted
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _kept_state() -> Iterator[None]:
    states = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        np.random.set_state(states[0])
        random.setstate(states[1])


def _number(value: Any) -> int | float | None:
    """A drawn number as a Python ``int`` or ``float`` (None: not one)."""
    if isinstance(value, np.generic) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


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
    if source.kind == "f":
        return target.kind == "f" and target in _TORCH
    if target not in _TORCH:
        return False
    return source.kind in "iu" and (target.kind == "f" or np.can_cast(source, target))


def _symbolic(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_symbolic(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_symbolic(v) for v in value)
    return isinstance(value, _SYMBOLS)


def _plain(value: Any) -> Any:
    """``value`` with its sizes as plain tuples and NumPy numbers as Python's, or None where
    it holds anything else (a traced number, an array)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic) and value.ndim == 0:
        return value.item()
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items()}
        return None if any(v is None and value[k] is not None for k, v in items.items()) else items
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        if any(p is None and v is not None for p, v in zip(items, value, strict=True)):
            return None
        return tuple(items) if isinstance(value, tuple) else items
    return None


# The module functions that draw a number, or (NumPy's, given a size) an array.
# fmt: off
_GENERATORS = {
    "np.random": (lambda: np.random, (
        "rand", "randn", "random", "random_sample", "ranf", "sample", "randint", "uniform",
        "normal", "standard_normal", "binomial", "poisson", "beta", "gamma", "exponential",
        "laplace", "lognormal", "multinomial", "choice", "permutation", "dirichlet",
    )),
    "random": (lambda: random, (
        "random", "uniform", "randint", "randrange", "gauss", "normalvariate", "triangular",
        "betavariate", "gammavariate", "expovariate", "lognormvariate", "vonmisesvariate",
        "paretovariate", "weibullvariate",
    )),
}
# fmt: on
_SYMBOLS = (torch.SymInt, torch.SymFloat)
