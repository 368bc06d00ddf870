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
leaves them. A Python branch on a drawn number (``if random.random() < p:``) is taken as
eager takes it: those draws are made ahead of each call to choose the program traced for
that path (up to :data:`MAX_BRANCHED_DRAWS` per trace). What a trace cannot follow is a
:class:`~functacc.TraceError`: computing with the array in NumPy first (``z * 2``,
``z[0]``), or a branch on more draws. Generator objects: :mod:`.generator_objects`.

Example:
    >>> import numpy as np
    >>> root = DrawRoot(0, "np.random", "normal", (0, 1, (2, 3)), {}, np.zeros((2, 3)))
    >>> root.label, tuple(root.get().shape)
    ('np.random.normal(0, 1, (2, 3)) (draw 1)', (2, 3))
"""

from __future__ import annotations

import contextlib
import copy
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
from .failure_sites import step_path
from .python_location import Location, Root

__all__ = [
    "MAX_BRANCHED_DRAWS",
    "DrawRoot",
    "HostDraws",
    "branched_on_draws",
    "draw_all",
]


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
        self.path: str | None = None  # the call to run before the step instead (step_path)
        # The generator drawn from: a module's, or a generator object read where the step
        # reads it (rng = np.random.default_rng(0); reassigned between calls, the new one).
        self.source = source if source is not None else _GENERATORS[module][0]
        self.global_generator = source is None
        # A number the step branched on (python_state): read between calls, this call's
        # value, drawn ahead with the draws before it and the generators put back (peeks).
        self.branched, self.before, self.peeks = False, [], None
        if isinstance(value, np.ndarray):
            with _disable_current_modes():  # made while tracing: a real tensor, not a fake
                self._layout: Any = torch.from_numpy(np.array(value))  # drawn once: its layout
        else:
            self._layout = _number(value)

    def _spec(self) -> Any:
        if not self.branched or self.peeks is None or _TRACING:
            return self._layout
        if self not in self.peeks:  # this call's draws up to this one, from copies of the
            clones: dict[int, Any] = {}  # generators: theirs untouched (another thread's too)
            for root in (*self.before, self):
                source = root.source()
                clone = clones.get(id(source)) or clones.setdefault(id(source), _copy(source))
                self.peeks[root] = root.draw(clone)
        return self.peeks[self]

    def _install(self, value: Any) -> None:  # a trace's graph input; the layout: none
        traced = isinstance(value, (Tensor, *_SYMBOLS)) and value is not self._layout
        self.traced = value if traced else None

    def draw(self, source: Any = None) -> Any:
        """This call's value, drawn from the generator as eager would (or from ``source``)."""
        source = self.source() if source is None else source
        value = getattr(source, self.name)(*self.args, **self.kwargs)
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else _number(value)


def draw_all(roots: list[DrawRoot]) -> dict[DrawRoot, Any]:
    """One call's draws, in the order its trace made them: those drawn ahead to choose its
    program must come again (else another thread drew from that generator meanwhile)."""
    drawn = {root: root.draw() for root in sorted(roots, key=lambda r: r.index)}
    for root, value in drawn.items():
        if root.branched and root in (root.peeks or {}) and root.peeks[root] != value:
            raise RuntimeError(
                f"{root.label} drew {value!r} where functacc had drawn {root.peeks[root]!r} "
                "ahead of the call, to choose the path of the step's branch on it: another "
                "thread drew from that generator in between. Fix: give that thread a "
                "generator of its own (random.Random(), np.random.default_rng())."
            )
    return drawn


def _copy(source: Any) -> Any:
    """A generator at ``source``'s state (the ``random`` or ``np.random`` module's own)."""
    if source is random:
        clone = random.Random()
        clone.setstate(random.getstate())
        return clone
    if source is np.random:
        clone = np.random.RandomState()
        clone.set_state(np.random.get_state())
        return clone
    return copy.deepcopy(source)


def branched_on_draws(
    branches: str, inputs: dict, fed: list[Location], drawn: list[Location], sites: Any
) -> None:
    """The draws a trace branched on (``branches``: its condition over ``t0, t1, ...``, the
    fed numbers in ``fed``'s order; ``inputs``: their symbols) are drawn ahead of each call
    to choose its program (``if random.random() < p:``, a trace per path taken). A trace
    that branched on more than :data:`MAX_BRANCHED_DRAWS` is refused: its paths multiply
    (teacher forcing decided at every step of a sequence)."""
    if not drawn:
        return
    numbers = [loc for loc in fed if not isinstance(inputs[loc], Tensor)]
    # Every float input's guard says it is not NaN; a drawn one is not.
    branches = re.sub(r"not math\.isnan\(L\['t\d+'\]\)", "", branches)
    used = {numbers[int(i)] for i in re.findall(r"L\['t(\d+)'\]", branches)}
    hit = [loc for loc in drawn if loc in used]
    if len(hit) > MAX_BRANCHED_DRAWS:
        site, statement = hit[0].root.site
        at = f" at {site}" if site else (f" at {', '.join(sites[:3])}" if sites else "")
        raise drawn_branch_error(hit[0].root.module, f"{hit[0].label}{at}", statement, len(hit))
    for loc in hit:
        loc.root.branched = True


MAX_BRANCHED_DRAWS = 3
"""The most draws one trace may branch on: each doubles the programs a step may need."""
_TRACING: list[bool] = []  # while a body is traced: draws give symbols, nothing peeks


class HostDraws:
    """The draws of one jitted body, across its traces (each a :class:`DrawRoot`)."""

    def __init__(self, fn: Any = None) -> None:
        self._roots: dict[tuple, DrawRoot] = {}
        self.new: list[Location] = []  # draws the last trace found that were not fed
        self.made: list[DrawRoot] = []  # the last trace's draws, in order
        self._lifts = Lifts()  # the arrays of the trace running
        # The step's code object: where the path to a draw in a function it calls starts.
        code = getattr(fn, "__code__", None)  # a function, a bound method
        self.body = code if code is not None else getattr(type(fn).__call__, "__code__", None)
        self._finder: tuple[list[DrawRoot], Lifts] | None = None  # the trace that found them
        self.peeked: dict[DrawRoot, Any] = {}  # this call's branched-on draws, drawn ahead

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
        _TRACING.append(True)
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
            _TRACING.pop()
            if self.new:  # (also where the trace stopped for another reason to learn)
                self._finder = (list(self.made), lifts)
            for owner, name, current in patched:
                setattr(owner, name, current)
            for root in self._roots.values():
                root.traced = None
            self._lifts = Lifts()

    def reached(self, roots: list[Root], modules: Any = ()) -> Any:
        """:func:`~.generator_objects.reached_generators`, fed by this body's draws."""
        from .generator_objects import reached_generators

        return reached_generators(roots, modules, self)

    def _check_constants(self, lifts: Lifts) -> None:
        """A constant of the graph that differs from the one the trace that found the draws
        made (its arrays had other values): computed from them where no check could see."""
        finder, self._finder = self._finder, None
        if finder is None or finder[0] != self.made or self.new:
            return
        where = lifts.changed_constant(finder[1])
        if where is not None:
            drawn = [r for r in self.made if isinstance(r._layout, Tensor)]
            raise drawn_computed_error(
                " or ".join(r.label for r in drawn),
                f"NumPy code reading its values, whose result reaches torch at {where}",
                next((r.path for r in drawn if r.path), None),
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
            root.path = step_path(sys._getframe(1), self.body) if self.body else None
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
            root = self._roots[key] = DrawRoot(index, *call)
            root.before, root.peeks = list(self.made), self.peeked  # the draws made before it
        return self._roots[key]


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
