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
import linecache
import os
import random
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import drawn_branch_error, drawn_computed_error
from .drawn_arrays import Lifts
from .python_location import Location, Root

__all__ = ["DrawRoot", "HostDraws", "branched_on_draws", "draw_all", "reached_generators"]


class DrawRoot(Root):
    """The ``index``-th draw of a trace: ``<module>.<name>(*args, **kwargs)``. Read between
    calls (a signature's key), it is a value of the draw's kind (an array's layout, a
    number's type); the plan draws it for real before each call (:func:`draw_all`)."""

    def __init__(
        self, index: int, module: str, name: str, args: tuple, kwargs: dict, value: Any,
        source: Any = None,
    ):  # fmt: skip
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        label = f"{module}.{name}({', '.join(shown)}) (draw {index + 1})"
        super().__init__(label, self._spec, self._install)
        self.index, self.module, self.name = index, module, name
        self.args, self.kwargs = args, kwargs
        self.traced: Any = None  # its graph input (a number's symbol) while a trace runs
        self.lifts: Lifts | None = None  # where the trace running keeps its arrays
        self.site: tuple[str, str | None] = ("", None)  # where drawn (python_draws._call_site)
        # The generator drawn from: a module's, or a generator object read where the step
        # reads it (rng = np.random.default_rng(0); reassigned between calls, the new one).
        self.source = source if source is not None else _GENERATORS[module][0]
        self.global_generator = source is None
        if isinstance(value, np.ndarray):
            with _disable_current_modes():  # made while tracing: a real tensor, not a fake
                self._layout: Any = torch.from_numpy(np.array(value))  # drawn once: its layout
        else:
            self._layout = _number(value)

    def _spec(self) -> Any:
        return self._layout

    def _install(self, value: Any) -> None:  # a trace's graph input; the layout: none

        traced = isinstance(value, (Tensor, *_SYMBOLS)) and value is not self._layout
        self.traced = value if traced else None

    def draw(self) -> Any:
        """This call's value, drawn from the global generator as eager would."""
        value = getattr(self.source(), self.name)(*self.args, **self.kwargs)
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else _number(value)


def draw_all(roots: list[DrawRoot]) -> dict[DrawRoot, Any]:
    """One call's draws, in the order its trace made them."""
    return {root: root.draw() for root in sorted(roots, key=lambda r: r.index)}


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
        site, statement = hit[0].root.site
        at = f" at {site}" if site else (f" at {', '.join(sites[:3])}" if sites else "")
        raise drawn_branch_error(hit[0].root.module, f"{hit[0].label}{at}", statement)


class HostDraws:
    """The draws of one jitted body, across its traces (each a :class:`DrawRoot`)."""

    def __init__(self) -> None:
        self._roots: dict[tuple, DrawRoot] = {}
        self.new: list[Location] = []  # draws the last trace found that were not fed
        self.made: list[DrawRoot] = []  # the last trace's draws, in order
        self._lifts = Lifts()  # the arrays of the trace running
        self._finder: tuple[list[DrawRoot], Lifts] | None = None  # the trace that found them

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """While a body is traced: the generators' functions, called by the tracing thread
        with plain arguments, give a fed input's symbol or a :class:`~.drawn_arrays.DrawnArray`
        (or, a draw not fed yet, its value: :attr:`new`, for the next trace)."""
        self.new, self.made, lifts = [], [], Lifts()
        self._lifts = lifts
        tracer = threading.get_ident()
        patched = []
        for module, (get, names) in _GENERATORS.items():
            for name in names:
                current = getattr(get(), name, None)
                if callable(current):
                    patched.append((get(), name, current))
                    setattr(get(), name, self._drawing(module, name, current, tracer))
        try:
            with lifts.mode():
                yield
            if lifts.refusal is not None:
                raise lifts.refusal
            self._check_constants(lifts)
            if self.new:  # found by this trace: the next one takes them as inputs
                from .python_trace import Retry

                raise Retry(self.new)
        finally:
            if self.new:  # (also where the trace stopped for another reason to learn)
                self._finder = (list(self.made), lifts)
            for owner, name, current in patched:
                setattr(owner, name, current)
            for root in self._roots.values():
                root.traced = None
            self._lifts = Lifts()

    def reached(self, roots: list[Root], modules: Any = ()) -> Any:
        """:func:`reached_generators`, their draws fed by this body's draws."""
        return reached_generators(roots, modules, self)

    def _check_constants(self, lifts: Lifts) -> None:
        """A constant of the graph that differs from the one the trace that found the draws
        made (its arrays had other values): computed from them where no check could see."""
        finder, self._finder = self._finder, None
        if finder is None or finder[0] != self.made or self.new:
            return
        where = lifts.changed_constant(finder[1])
        if where is not None:
            raise drawn_computed_error(
                " or ".join(r.label for r in self.made if isinstance(r._layout, Tensor)),
                f"NumPy code reading its values, whose result reaches torch at {where}",
            )

    def _drawing(
        self, module: str, name: str, current: Any, tracer: int, source: Any = None
    ) -> Any:
        original = getattr(current, "__wrapped__", current)  # under HostRandomWatch's note
        generator = source() if source is not None else None

        @functools.wraps(original)
        def draw(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != tracer:
                return current(*args, **kwargs)
            plain = _plain((args, kwargs))
            if plain is None and _symbolic((args, kwargs)):  # a size kept symbolic (x.shape[0])
                from .tracer import _MixedGuard

                raise _MixedGuard(f"sizes fixed: {module}.{name} draws with one of them")
            if plain is None:
                return current(*args, **kwargs)
            with _kept_state(generator):  # the plan draws it before each call, not the trace
                value = original(*args, **kwargs)
            if not isinstance(value, np.ndarray) and _number(value) is None:
                return current(*args, **kwargs)  # random.choice(names): as before, an error
            root = self._root(len(self.made), module, name, *plain, value, source)
            root.site = _call_site(sys._getframe(1))
            self.made.append(root)
            if root.traced is None:
                self.new.append(Location(root))
            if not isinstance(value, np.ndarray):  # its symbol (this trace's value: redone)
                return value if root.traced is None else root.traced
            return self._lifts.add(value, root, rotate=root.traced is not None)

        return draw

    def _root(self, index: int, *call: Any) -> DrawRoot:
        module, name, args, kwargs, value, _ = call
        kind = "array" if isinstance(value, np.ndarray) else type(_number(value)).__name__
        key = (index, module, name, repr(args), repr(sorted(kwargs.items())), kind)
        if key not in self._roots:
            self._roots[key] = DrawRoot(index, *call)
        return self._roots[key]


@contextlib.contextmanager
def reached_generators(roots: list[Root], modules: Any = (), draws: Any = None) -> Iterator[None]:
    """While a body is traced, a generator object it reaches (a closure variable or global
    ``rng = np.random.default_rng(0)``, a ``np.random.RandomState``, a ``random.Random``,
    also in a dict, list or plain object) is a :class:`_StandIn` there, whose draws with
    plain arguments ``draws`` (the :class:`HostDraws`) feeds as it does the module
    functions'. Any other use that draws from it (``rng.shuffle(a)``, a library holding it)
    is refused, its state put back: the draw would be a constant of the graph. One the
    step's ``modules`` hold is the tracer's to refuse (``HeldRandomWatch``). Entered before
    the body's recording starts: finding them reads no recorded list."""
    from .python_reach import held, plain_objects
    from .watches import (
        _generator_state,
        _held_generators,
        _is_host_generator,
        _same,
        _set_generator_state,
    )

    kinds = (random.Random, np.random.Generator, np.random.RandomState)
    variables = [(Location(root), root.get()) for root in roots]
    reached = held(variables, plain_objects(roots).values(), kinds)
    found = {id(g): (loc, g) for loc, g in reached}
    for _, module in modules:
        for g in _held_generators(module).values():
            found.pop(id(g), None)
    before = [(loc, g, _generator_state(g)) for loc, g in found.values() if _is_host_generator(g)]
    stand_ins = []
    if draws is not None:
        for loc, g in reached:
            if id(g) in found and _is_host_generator(g) and loc.get() is g:
                stand_ins.append((loc, g, _StandIn(g, draws, loc)))
                loc.set(stand_ins[-1][2])
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        for loc, g, stand_in in stand_ins:
            if loc.get() is stand_in:
                loc.set(g)
        drawn = [(loc, g) for loc, g, state in before if not _same(state, _generator_state(g))]
        for _, g, state in before:
            _set_generator_state(g, state)
        if drawn and not failed:
            from ..errors import host_random_error

            raise host_random_error([f"{loc.label} ({type(g).__name__})" for loc, g in drawn])


class _StandIn:
    """A generator object where the step reads it while a trace runs: its drawing methods
    are fed draws (``rng.normal(0, 1, (n, d))``), anything else is the generator's own."""

    def __init__(self, generator: Any, draws: HostDraws, location: Location):
        names = _GENERATORS["random" if isinstance(generator, random.Random) else "np.random"][1]
        if isinstance(generator, np.random.Generator):
            names = (*names, "integers", "standard_exponential", "standard_gamma")
        tracer = threading.get_ident()
        self._generator, self._methods = (
            generator,
            {
                name: draws._drawing(location.label, name, method, tracer, location.get)
                for name in names
                if callable(method := getattr(generator, name, None))
            },
        )

    def __getattr__(self, name: str) -> Any:
        methods = self.__dict__.get("_methods", {})
        return methods[name] if name in methods else getattr(self._generator, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(rng, np.random.Generator), as in eager
        return type(self._generator)


@contextlib.contextmanager
def _kept_state(generator: Any = None) -> Iterator[None]:
    from .watches import _generator_state, _set_generator_state

    states = np.random.get_state(), random.getstate()
    own = _generator_state(generator) if generator is not None else None
    try:
        yield
    finally:
        np.random.set_state(states[0])
        random.setstate(states[1])
        if generator is not None:
            _set_generator_state(generator, own)


def _number(value: Any) -> int | float | None:
    """A drawn number as a Python ``int`` or ``float`` (None: not one)."""
    if isinstance(value, np.generic) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _call_site(frame: Any) -> tuple[str, str | None]:
    """Where a draw was made (``file:line in function``) and, where that is a library's
    code, the step's statement that called into it (``x, y = mixup_fn(x, y)``)."""
    from .python_output import is_user_code

    site = (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )
    if is_user_code(frame.f_code.co_filename):
        return site, None
    while frame is not None and not is_user_code(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return site, None
    return site, linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() or None


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
