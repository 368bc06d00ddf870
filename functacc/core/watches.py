"""What a trace must refuse: Python state the step changes or draws from while tracing.

The tracer (:mod:`.tracer`) runs the step's Python once per signature, where eager runs it
every step. A forward that changes its modules' Python attributes (a call counter, a
tensor stored on ``self``) or draws from Python's or NumPy's generators (a layer-drop
decision) would be replayed wrong at every later step. The watches here, entered around
each trace, make those errors and put the state back.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from torch import Tensor, nn

from ..errors import argument_error, attribute_change_error, host_random_error, user_stacklevel
from .failure_sites import draw_site
from .held_objects import contents_changed, note_contents, restore_contents
from .model_watch import HELD_DEPTH, held_items
from .python_clock import fed_clock
from .python_reach import MODULE_TABLES

__all__ = ["AttributeWatch", "ClockWatch", "GradWatch", "HeldRandomWatch", "HostRandomWatch"]

_FUNCTACC_DIR = os.path.dirname(os.path.dirname(__file__))  # the package, not core/

_MODULE_INTERNALS = MODULE_TABLES | {"training"}

# Caches torch's own modules rebuild in their forward whenever the tensors they were built
# from are not the module's own (the trace swaps in its inputs): ``RNNBase`` keeps its
# weights as a list for ``_VF.lstm`` & co. and weak references to check them against.
# Torch's state, not the user's: put back after the trace (it then holds the trace's fake
# tensors), neither an error nor part of the signature.
_TORCH_CACHES: tuple[tuple[type[nn.Module], frozenset[str]], ...] = (
    (nn.RNNBase, frozenset({"_flat_weights", "_flat_weight_refs"})),
)


def _torch_caches(module: nn.Module) -> frozenset[str]:
    """The attributes of ``module`` that torch itself keeps as a cache (see ``_TORCH_CACHES``)."""
    for kind, names in _TORCH_CACHES:
        if isinstance(module, kind):
            return names
    return frozenset()


class AttributeWatch:
    """Refuses a forward that changes the model's Python attributes.

    A compiled step runs the forward's Python once per trace, not once per step: a counter
    kept as ``self.calls += 1`` would stop counting, and a tensor stored as
    ``self.last = out.mean()`` would be a tracing placeholder, not a value. Eager runs them
    every step, so both are errors (the attributes are put back) that name the modules:
    a jitted body's Python state then follows those modules' attributes from the next
    trace on (:meth:`.python_state.PythonState.retry`). Setting an attribute
    that was ``None`` or absent to a non-tensor (a lazily built cache) happens once in
    eager too, and is allowed. The caches torch's own modules rebuild when the trace swaps
    their tensors (``nn.LSTM``'s ``_flat_weights``) are put back without an error.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.before = {
            name: {k: (v, _contents(v)) for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
            for name, m in self.model.named_modules()
        }

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        changed, modules = [], []
        for name, module in self.model.named_modules():
            before = self.before.get(name, {})
            attrs = vars(module)
            caches = _torch_caches(module)
            for k, v in list(attrs.items()):
                if k in _MODULE_INTERNALS:
                    continue
                old, contents = before.get(k, (None, {}))
                if k in before and v is old and not contents_changed(contents):
                    continue  # unchanged, also inside (a dict or list filled in place)
                if old is None and not isinstance(v, Tensor) and k not in caches:
                    continue  # a lazily built cache: set once, in eager too
                if k not in caches:
                    changed.append(f"{name}.{k}" if name else k)
                    modules.append((module, k))
                if k in before:
                    attrs[k] = old
                    restore_contents(contents)  # lucidrains' `self.cache[key] = freqs`
                else:
                    del attrs[k]
        if changed and kind is None:
            error = attribute_change_error(changed)
            # Which modules: a jitted body's Python state follows them from its next trace
            # (PythonState.retry), as it follows a plain object's attributes.
            error.changed_modules = list({id(m): m for m, _ in modules}.values())
            error.changed_attributes = modules
            raise error


class GradWatch:
    """Refuses a step that sets ``.grad`` of the modules' parameters themselves while traced.

    The trace runs the body over tensors that stand for the parameters; code that reaches
    the parameters another way, an optimizer missing from ``optimizers=`` (its
    ``zero_grad()``) or a list taken before the call, writes the real ``.grad`` once, at
    the trace: eager clears them every step, the traced step then accumulated into them
    and left them ``None``. The gradients are put back and the error names the fix.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.before = {n: (p, p.grad) for n, p in self.model.named_parameters()}

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        changed = [n for n, (p, grad) in self.before.items() if p.grad is not grad]
        for n in changed:
            p, grad = self.before[n]
            p.grad = grad
        if changed and kind is None:
            raise argument_error(
                f"the step set .grad of the parameters {', '.join(changed[:3])}"
                f"{' ...' if len(changed) > 3 else ''} themselves while traced, not of what "
                "the traced step holds in their place: an optimizer missing from "
                "optimizers= (its zero_grad()), or a parameter list taken before the call. "
                "Eager does that every step; the traced step would do it once. Fix: pass "
                "every optimizer the body touches in optimizers=(...), also one whose "
                "step() runs outside the jitted function, and read parameters through the "
                "module inside the step."
            )


class HostRandomWatch:
    """Refuses a forward (or loss) that draws from Python's or NumPy's global generator.

    A compiled step runs the forward's Python code once, when it traces: a layer-drop or
    stochastic-depth decision taken with ``random.random()`` would be taken once and
    replayed at every step, where eager takes a new one each step. Draws from torch's
    generators are ops in the graph and are drawn again at every step.

    Other Python threads may draw from the same generators meanwhile (a dataset's
    augmentations on a loader's prefetch thread; Inductor's and tqdm's threads live on in
    most processes). So while tracing, the module functions (``random.random``,
    ``np.random.rand``, ...) note whether the tracing thread calls them: that is an error
    whatever else runs. A changed state with no such call (a function imported by name
    before, ``from random import random``) is an error only when no other Python thread
    runs, and a warning otherwise. The generators are put back when no other thread runs,
    or when the tracing thread drew and no other thread called these functions meanwhile;
    otherwise putting them back would make the other threads repeat their numbers.
    """

    def __enter__(self) -> None:
        self.before = _host_rng_states()
        self.alone = threading.active_count() == 1
        self.tracer = threading.get_ident()
        self.called: set[str] = set()  # generators the tracing thread drew from
        self.sites: dict[str, tuple[str, str | None]] = {}  # ... where it drew first
        self.others: set[str] = set()  # ... and other threads, through the same functions
        self.patched = []
        for label, module in _host_random_modules():
            for name in _DRAWING[label]:
                original = getattr(module, name, None)
                if callable(original):
                    self.patched.append((module, name, original))
                    setattr(module, name, self._noting(label, original))

    def _noting(self, label: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def draw(*args: Any, **kwargs: Any) -> Any:
            tracing = threading.get_ident() == self.tracer
            (self.called if tracing else self.others).add(label)
            if tracing and label not in self.sites:
                site, statement = draw_site()
                self.sites[label] = (f"{label}.{original.__name__}, at {site}", statement)
            return original(*args, **kwargs)

        return draw

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        for module, name, original in self.patched:
            setattr(module, name, original)
        after = _host_rng_states()
        changed = [name for name, state in self.before.items() if not _same(state, after[name])]
        if not changed:
            return
        alone = self.alone and threading.active_count() == 1
        drawn = [g for g in changed if alone or g in self.called]
        if alone or (drawn and not self.others):
            random.setstate(self.before["random"])
            if "numpy.random" in self.before:
                sys.modules["numpy"].random.set_state(self.before["numpy.random"])
        if drawn and kind is None:
            first = next((self.sites[g] for g in drawn if g in self.sites), (None, None))
            raise host_random_error(drawn, *first)
        if not drawn:
            warnings.warn(
                f"{host_random_error(changed)} (Other Python threads were running, and one "
                "of them may have drawn instead; if your forward and loss do not use these "
                "generators, ignore this.)",
                stacklevel=user_stacklevel(),
            )


class HeldRandomWatch:
    """Refuses a forward that draws from a Python or NumPy generator the model holds
    (``self.rng = np.random.default_rng(0)``, ``random.Random(0)``; in a module's
    attributes, private ones too, or in a dict, list or plain object there, three levels
    deep). As with the global generators, the trace would draw once and every step would
    replay those numbers. The generator is the model's own, so no other thread is assumed to
    draw from it: any change of its state while tracing is the forward's. Its state is put
    back."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.held = _held_generators(self.model)
        self.before = {where: _generator_state(g) for where, g in self.held.items()}

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        drawn = [
            where
            for where, g in self.held.items()
            if not _same(self.before[where], _generator_state(g))
        ]
        for where in drawn:
            _set_generator_state(self.held[where], self.before[where])
        if drawn and kind is None:
            raise host_random_error(
                [f"the model's {type(self.held[w]).__name__} {w}" for w in drawn]
            )


def _held_generators(model: nn.Module) -> dict[str, Any]:
    """The Python and NumPy generators the model's modules hold, by where they sit."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def visit(value: Any, where: str, depth: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if _is_host_generator(value):
            found[where] = value
            return
        inside = held_items(value, private=True) if depth < HELD_DEPTH else None
        if inside is not None:
            kind, items = inside
            for label, v in items:
                visit(v, f"{where}.{label}" if kind == "object" else f"{where}{label}", depth + 1)

    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in _MODULE_INTERNALS:
                visit(value, f"{name}.{attr}" if name else attr, 0)
    return found


def _is_host_generator(value: Any) -> bool:
    if isinstance(value, random.Random):
        return not isinstance(value, random.SystemRandom)  # stateless: nothing to replay
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(
        value, (numpy.random.Generator, numpy.random.RandomState)
    )


def _generator_state(g: Any) -> Any:
    if isinstance(g, random.Random):
        return g.getstate()
    if hasattr(g, "bit_generator"):  # numpy.random.Generator
        return g.bit_generator.state
    return g.get_state()  # numpy.random.RandomState


def _set_generator_state(g: Any, state: Any) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state
    else:
        g.set_state(state)


class ClockWatch:
    """The clock read by a step's own code (``time.time()``, ``perf_counter()``, ...): its
    Python runs once, at the trace, so the time read there would be every call's (minGPT's
    trainer, ``tnow = time.time(); self.iter_dt = tnow - self.iter_time``, then went back in
    time on every call). A jitted body's numeric reads are fed (:mod:`.python_clock`); the
    others (``ctime()``, a plain traced function's) are refused. Only calls from the user's
    code on the tracing thread count: torch, functacc, installed packages and other threads
    (a loader's, tqdm's) read clocks meanwhile."""

    _READS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns")
    # These read it when not given a time: time.ctime() in fast_neural_style's log line.
    _READS_UNLESS_GIVEN: ClassVar[dict[str, int]] = {  # name -> the time argument's position
        "ctime": 0, "localtime": 0, "gmtime": 0, "asctime": 0, "strftime": 1,
    }  # fmt: skip

    def __enter__(self) -> None:
        self.tracer = threading.get_ident()
        self.reads = 0  # the step's clock reads so far: each one fed (python_clock)
        names = [*self._READS, *self._READS_UNLESS_GIVEN]
        self.patched = [(name, getattr(time, name)) for name in names]
        for name, original in self.patched:
            setattr(time, name, self._refusing(name, original))

    def _refusing(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        from .python_output import is_user_code

        @functools.wraps(original)
        def read(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            where = os.path.abspath(caller.f_code.co_filename)
            given = self._READS_UNLESS_GIVEN.get(name)
            reads = given is None or len(args) <= given or args[given] is None
            if reads and threading.get_ident() == self.tracer and is_user_code(where):
                fed = fed_clock(name, self.reads)
                self.reads += 1
                if fed is not None:
                    return fed
                raise argument_error(
                    f"the step reads the clock (time.{name}() at {where}:{caller.f_lineno}); "
                    "functacc runs a step's Python once, when it traces, so every call would "
                    "see the time of the trace (an iteration time computed in the step goes "
                    "wrong from the second call). Fix: read the clock outside the step, around "
                    "the call: t0 = time.time(); step(x, y); dt = time.time() - t0.",
                    RuntimeError,
                )
            return original(*args, **kwargs)

        return read

    def __exit__(self, *exc: object) -> None:
        for name, original in self.patched:
            setattr(time, name, original)


# The module functions that draw from the global generators (NumPy's legacy RandomState).
# fmt: off
_DRAWING = {
    "random": (
        "random", "uniform", "triangular", "randint", "randrange", "choice", "choices",
        "sample", "shuffle", "gauss", "normalvariate", "lognormvariate", "expovariate",
        "vonmisesvariate", "gammavariate", "betavariate", "paretovariate", "weibullvariate",
        "getrandbits", "randbytes", "binomialvariate",
    ),
    "numpy.random": (
        "rand", "randn", "random", "random_sample", "ranf", "sample", "randint",
        "random_integers", "choice", "shuffle", "permutation", "uniform", "normal",
        "standard_normal", "binomial", "poisson", "beta", "gamma", "exponential", "bytes",
    ),
}
# fmt: on


def _host_random_modules() -> list[tuple[str, Any]]:
    numpy = sys.modules.get("numpy")
    return [("random", random)] + ([("numpy.random", numpy.random)] if numpy else [])


def _host_rng_states() -> dict[str, Any]:
    """The states of the global generators outside torch (NumPy's only if it is loaded)."""
    states: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy.random"] = numpy.random.get_state()
    return states


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):  # a NumPy bit generator's state
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):  # NumPy's key array
        return a.tobytes() == b.tobytes()
    return a == b


def _contents(value: object) -> dict[int, tuple[Any, list]]:
    """The items of ``value``'s dicts and lists (itself and nested), to compare and put
    back: a trace that fills a module's cache dict in place leaves its fake tensors there."""
    contents: dict[int, tuple[Any, list]] = {}
    note_contents(value, contents)
    return contents
