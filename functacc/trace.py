"""What a trace must refuse, and how failures of tracing and running read.

The tracer (:mod:`functacc.core.tracer`) runs the step's Python once per signature, where
eager runs it every step. So a forward that changes its modules' Python attributes or
draws from a Python or NumPy generator would be replayed wrong: the watches here make that
an error. Failures of tracing or of a compiled run become :class:`~functacc.TraceError`
naming the module, the source line and the inputs; a run that fails puts the random
generators back (:func:`rng_state`, :func:`set_rng_state`).
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule

from . import _compat
from .errors import TraceError, attribute_change_error, host_random_error
from .signature import HELD_DEPTH, held_items

__all__ = [
    "AttributeWatch",
    "HeldRandomWatch",
    "HostRandomWatch",
    "describe_tensor",
    "draws_random",
    "rng_state",
    "run_error",
    "set_rng_state",
    "translate",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FUNCTACC_DIR = os.path.dirname(__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)


def describe_tensor(t: Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{tuple(t.shape)} {dtype} on {t.device}"


def _is_data_dependent(exc: BaseException) -> bool:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    data_dependent = (
        DataDependentOutputException,
        DynamicOutputShapeException,
        GuardOnDataDependentSymNode,
    )
    while exc is not None:
        if isinstance(exc, data_dependent):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame that is neither torch, functacc nor the standard library."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if frame.filename.startswith("<"):  # generated code (FX, dataclasses, eval)
            continue
        path = os.path.abspath(frame.filename)
        if not path.startswith((_TORCH_DIR, _FUNCTACC_DIR, _STDLIB_DIR)):
            return frame
    return None


def _user_module(tb: TracebackType | None, model: nn.Module) -> str | None:
    """The qualified name of the innermost module of ``model`` whose code was running."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, nn.Module) and id(candidate) in names:
            name = names[id(candidate)]
            found = (
                f"'{name}' ({type(candidate).__name__})"
                if name
                else (f"the model's root ({type(candidate).__name__})")
            )
        tb = tb.tb_next
    return found


def _where(exc: BaseException, model: nn.Module) -> str:
    tb = exc.__traceback__
    frame = _user_frame(tb)
    module = _user_module(tb, model)
    parts = []
    if module:
        parts.append(f"in module {module}")
    if frame is not None:
        parts.append(f"at {frame.filename}:{frame.lineno}")
        if frame.line:
            parts.append(f"\n    {frame.line.strip()}")
    return " ".join(parts) if parts else "(location unknown)"


_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}


class AttributeWatch:
    """Refuses a forward that changes the model's Python attributes.

    A compiled step runs the forward's Python once per trace, not once per step: a counter
    kept as ``self.calls += 1`` would stop counting, and a tensor stored as
    ``self.last = out.mean()`` would be a tracing placeholder, not a value. Eager runs them
    every step, so both are errors (the attributes are put back). Setting an attribute
    that was ``None`` or absent to a non-tensor (a lazily built cache) happens once in
    eager too, and is allowed.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.before = {
            name: {k: (v, _size(v)) for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
            for name, m in self.model.named_modules()
        }

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        changed = []
        for name, module in self.model.named_modules():
            before = self.before.get(name, {})
            attrs = vars(module)
            for k, v in list(attrs.items()):
                if k in _MODULE_INTERNALS:
                    continue
                old, size = before.get(k, (None, None))
                if k in before and v is old and _size(v) == size:
                    continue  # unchanged (an in-place container edit changes its size)
                if old is None and not isinstance(v, Tensor):
                    continue  # a lazily built cache: set once, in eager too
                changed.append(f"{name}.{k}" if name else k)
                if k in before:
                    attrs[k] = old
                else:
                    del attrs[k]
        if changed and kind is None:
            raise attribute_change_error(changed)


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
            raise host_random_error(drawn)
        if not drawn:
            warnings.warn(
                f"{host_random_error(changed)} (Other Python threads were running, and one "
                "of them may have drawn instead; if your forward and loss do not use these "
                "generators, ignore this.)",
                stacklevel=_caller_level(),
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


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside functacc (the user's ``step(...)``),
    counted from the function that calls ``warnings.warn``."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_FUNCTACC_DIR):
        frame, level = frame.f_back, level + 1
    return level


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


def _size(value: object) -> int | None:
    return len(value) if isinstance(value, (list, dict, set)) else None


def translate(exc: BaseException, model: nn.Module, signature: str) -> TraceError:
    where = _where(exc, model)
    if _is_data_dependent(exc):
        return TraceError(
            "functacc traces the whole training step once into a graph, so Python code "
            "cannot branch on tensor values (if/while on a tensor, .item(), .tolist(), "
            f"data-dependent shapes such as nonzero()), but the step does so {where}\n"
            "Expected: control flow that depends only on shapes, dtypes and Python values. "
            "Fix: replace the branch with tensor ops, e.g. torch.where(cond, a, b) or "
            "torch.cond(pred, true_fn, false_fn, operands), or move the check out of "
            f"forward(). Inputs were: {signature}."
        )
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if (
        isinstance(exc, NotImplementedError)
        and "Generator" in message
        and not _compat.make_fx_traces_generators()
    ):
        return TraceError(
            f"the training step draws from a torch.Generator passed to an op {where}\n"
            f"torch {torch.__version__} cannot trace that ({type(exc).__name__}: {message}); "
            "torch 2.14 and later can. Fix: draw from torch's default generator (leave out "
            "generator=, seed with torch.manual_seed) or install a newer torch (pip install "
            "'torch>=2.14,<2.16')."
        )
    return TraceError(
        f"tracing the training step failed {where}\n"
        f"{type(exc).__name__}: {message}\n"
        f"Inputs were: {signature}. Check that the inputs have the shapes, dtypes and "
        "devices the model expects (the same call must work in eager PyTorch: "
        "loss_fn(model(inputs), targets))."
    )


def _is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    text = f"{type(exc).__name__} {exc}".lower()
    markers = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "c10d")
    return isinstance(exc, getattr(dist, "DistError", ())) or any(m in text for m in markers)


def run_error(exc: BaseException, signature: str) -> TraceError:
    """A compiled step that traced fine but failed while running (fake tensors do not check
    every rule, e.g. some dtype mismatches; or a collective failed). The step writes its
    state only after all computation, so nothing was updated."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _is_collective_failure(exc):
        return TraceError(
            "a collective of the training step failed: another rank has probably exited or "
            "crashed, or the network between ranks failed. This rank's model and optimizer "
            f"are unchanged by the failed step.\n{type(exc).__name__}: {message}\nEvery rank "
            "waits for the others at most the process group's timeout "
            "(functacc.init_distributed(timeout=...) or FUNCTACC_TIMEOUT seconds); restart "
            "the job from the last checkpoint (torchrun --max-restarts does it automatically)."
        )
    return TraceError(
        f"the compiled training step failed while running, before it wrote any state (model, "
        f"optimizer and step count are unchanged)\n{type(exc).__name__}: {message}\n"
        f"Inputs were: {signature}. Check that the inputs have the dtypes and devices the "
        "model expects (the same call fails in eager PyTorch too)."
    )


def draws_random(gm: GraphModule) -> bool:
    """Whether the graph draws random numbers (dropout, ``torch.rand``): a call that fails
    after drawing must put the generators back."""
    seeded = torch.Tag.nondeterministic_seeded
    return any(seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes)


def rng_state(devices: Collection[torch.device]) -> tuple[Tensor, dict[torch.device, Tensor]]:
    """The CPU generator's state and that of each of ``devices`` that is a GPU."""
    cuda = {d for d in devices if d.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


def set_rng_state(state: tuple[Tensor, dict[torch.device, Tensor]]) -> None:
    """Put back what :func:`rng_state` read."""
    torch.set_rng_state(state[0])
    for device, cuda in state[1].items():
        torch.cuda.set_rng_state(cuda, device)
