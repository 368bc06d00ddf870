"""The Python state a jitted step body reads and writes: eager's values on every call.

A body's Python runs once per trace; eager runs it on every call. :class:`PythonState`
makes the difference invisible, or an error, location by location (:mod:`.python_reach`
finds them, :mod:`.python_trace` records a trace's reads and writes):

- **a scalar the body reads** (a closure float, a global, ``self.scale``, a config entry,
  ``opt.param_groups[0]["momentum"]``) is baked into the graph and *guarded*: it is part
  of the step's signature, so a changed value retraces (named in ``step.traces``). A
  number that has changed once is then *fed* instead: a graph input read afresh on every
  call, with no further retrace (as ``torch.compile``'s automatic dynamic does);
- **a counter** (a number the body reads and writes: ``self.step += 1``) is fed from the
  first trace, and its new value is computed by the graph and written back after the call;
- **an optimizer's hyperparameters** read by the body (``group["lr"]``) are the values the
  graph is fed already for ``opt.step()``: a schedule changes them without a retrace;
- **writes** (an attribute, a variable, a dict entry, ``param_groups``, a list append) are
  replayed after every call with eager's values; ``lr_scheduler.step()`` and
  ``torch.manual_seed(...)`` inside the body are run for real, before or after the graph,
  where the body has them; a seeded ``torch.Generator`` is put back to its seeded state;
- what cannot be replayed is a :class:`~functacc.TraceError` naming it, with nothing changed.

A fed number the body branches on (``if self.step % 100 == 0``) is a guard on it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

from ..errors import TraceError
from .host_calls import result_unused
from .python_clock import new_call
from .python_code import called_toward, code_scopes, module_classes, reached_code, unlisted_modules
from .python_draws import DrawRoot, HostDraws, branched_on_draws, draw_all
from .python_effects import build
from .python_location import MISSING, Location, ModuleRoot, Root
from .python_numpy import NUMBERS
from .python_reach import find_roots, is_user_code
from .python_recording import groups_root
from .python_replay import QUIET, Conditions, Exact, PythonPlan, Replay
from .python_schedulers import last_lrs
from .python_tensors import HeldTensors, fed_key, feedable, module_containers
from .python_trace import Recorder, Retry

__all__ = ["Exact", "PythonPlan", "PythonState", "Replay", "Retry", "generator_key"]


class PythonState:
    """The Python state of one jitted body, across its traces and calls."""

    def __init__(
        self,
        fn: Callable[..., Any],
        optimizers: Sequence[Any],
        owned: Callable[[], set[int]] = set,
        modules: Sequence[tuple[str, Any]] = (),
        unkeyed: set[tuple[int, str]] | None = None,
    ):
        # Roots: the body's code's, its modules' containers and classes; hooks' in prepare().
        self._known: dict[tuple, Root] = {}
        self.roots: list[Root] = find_roots(fn, self._known) + module_containers(modules)
        self.roots += module_classes(modules)
        self._fn = fn  # where its branches are made (finish)
        self.optimizers = list(optimizers)  # LinkedOptimizer
        self.owned = owned  # ids of the step's own tensors: never fed (python_tensors)
        self.guards: dict[Location, None] = {}  # over every trace so far, in order
        self.fed: dict[Location, None] = {}
        self.loose = HeldTensors()  # where its variables hold the step's own tensors
        self.pinned: set[Location] = set()  # fed once, but branched on: guarded for good
        self.traced_values: dict[Location, Any] = {}
        self._recorder: Recorder | None = None
        self._owned: set[int] = set()
        # Per trace with fed numbers it branched on: that condition, over the fed locations.
        self.branches: list[tuple[Callable[[dict], bool], list[Location], str]] = []
        self._branch_checks: dict[tuple, tuple] = {}  # (condition, fed) -> (check, numbers)
        # Whether traces follow .item() of the modules' one-element buffers (scalar_reads):
        # from the first trace that branched on a value it could not name.
        self.item_reads = False
        self._learned: list[Any] = []  # what the last failed trace found (unsettled())
        self._scalar_buffers = any(b.numel() == 1 for _, m in modules for b in m.buffers())
        self._modules = list(modules)
        self._followed: set[int] = set()  # modules whose attributes it writes (ModuleRoot)
        self.unkeyed = set() if unkeyed is None else unkeyed  # (id(module), attr): not keyed
        self.draws = HostDraws(fn)  # np.random's arrays in the body, fed (python_draws)

    # -- per call ------------------------------------------------------------------------
    def new_call(self) -> None:
        """A call starts: its clock reads and branched-on draws are made afresh, once."""
        new_call()
        self.draws.peeked.clear()

    def key(self) -> tuple:
        """The part of the signature the body's Python reads: the guarded values and the
        types of the fed ones."""
        if not self.guards and not self.fed and not self.loose:
            return ()
        guarded = tuple((loc.label, Exact(loc.get())) for loc in self.guards)
        if self.loose:  # still the step's tensor there (a new one: another trace)
            guarded += (("moved", self.loose.moved()),)
        fed = tuple((loc.label, fed_key(loc.get())) for loc in self.fed)
        if not self.branches:
            return guarded + fed
        # Each trace's branches on fed numbers (if self.step % 100 == 0): which hold now.
        held = tuple(
            (label, check({f"t{i}": x.get() for i, x in enumerate(xs)}))
            for check, xs, label in self.branches
        )
        return (*guarded, *fed, *held)

    def holds(self, program: Any) -> bool:
        """Whether ``program``'s trace holds for this call's Python state."""
        conditions = getattr(getattr(program, "python", None), "conditions", None)
        return conditions is not None and conditions.hold()

    def inputs(self, plan: PythonPlan | None = None, replay: Replay = QUIET) -> list[int | float]:
        """The fed values now: the graph's Python-number and Python-state tensor inputs (a
        run's arrays drawn from NumPy by ``replay``; a trace's: their layout)."""
        fed = plan.fed if plan is not None else self.fed
        roots = [getattr(loc, "root", None) for loc in fed]  # a clock read has none
        drawn = replay.drawn
        return [
            _as_input(drawn[r] if r in drawn else loc.get())
            for loc, r in zip(fed, roots, strict=True)
        ]

    # -- tracing -------------------------------------------------------------------------
    def prepare(self) -> list[Location]:
        """Before a trace: numbers whose guarded value changed since an earlier trace are
        fed from now on (automatic dynamic); fed values that are no longer numbers are not."""
        for loc in list(self.guards):
            value, before = loc.get(), self.traced_values.get(loc, MISSING)
            length = loc.steps[-1:] == (("len", None),)  # a list's: guarded for good
            changed = _numeric(value) and _numeric(before) and value != before
            if loc not in self.pinned and not length and changed:
                del self.guards[loc]
                self.fed[loc] = None
        for linked in self.optimizers:  # an optimizer traced whole: its numbers are fed
            numbers = getattr(linked, "numbers", None)
            for loc in numbers(groups_root(linked)) if numbers is not None else ():
                if loc not in self.pinned:
                    self.fed.setdefault(loc, None)
                    self.guards.pop(loc, None)
        self.roots += unlisted_modules(self.roots, self._modules, self._known)  # crit = MyLoss()
        for hook in reached_code(self._modules, self.roots):  # feats[name] = out, forward()'s
            self.roots += find_roots(hook, self._known)
        owned = self.owned()
        for loc in list(self.fed):
            value = loc.get()
            if not (_numeric(value) or feedable(value, owned)):
                del self.fed[loc]
                self.pinned.add(loc)
        self._owned = owned
        return list(self.fed)

    @contextlib.contextmanager
    def scope(self, fed: Sequence[Location], placeholders: Sequence[Tensor]) -> Iterator[Recorder]:
        symbolic = dict(zip(fed, placeholders, strict=True))
        recorder = Recorder(self.roots, symbolic, self.optimizers, self.pinned, self._owned)
        recorder.item_reads = self.item_reads
        recorder.scopes = code_scopes(self._fn)  # its names for output functions (save_image)
        self._recorder = recorder
        with self.draws.reached(self.roots, self._modules), recorder, self.draws.tracing():
            yield recorder

    def unsettled(self) -> str:
        """Why tracing stopped learning the body's Python state: what the last trace found."""
        found = ", ".join(getattr(loc, "label", str(loc)) for loc in self._learned[:4])
        return (
            "its Python state kept changing: each trace found more of it to feed to the graph "
            f"or to guard (the last found {found or 'a branch on a fed number'}). Fix: keep "
            "the tensors and numbers the step reads in fewer places (a module's buffers, "
            "given in modules=), or pass them as arguments."
        )

    def retry(self, exc: BaseException) -> bool:
        """After a failed trace: whether tracing again can succeed — counters to feed
        (:class:`Retry`), or fed values the body branched on, to guard instead."""
        recorder = self._recorder
        if self._follow(
            getattr(exc, "changed_modules", ()), getattr(exc, "changed_attributes", ())
        ):
            return True
        promote = exc.promote if isinstance(exc, Retry) else []
        promote = list(dict.fromkeys([*promote, *self.draws.new]))  # np.random's arrays
        self._learned = list(promote)
        if not promote and recorder is not None:  # a tensor of its Python state: feed it
            promote = recorder.unfed_tensors()
            if not promote and _outside_tensor(exc):  # torch.stack(self.states) read them
                promote = recorder.unfed_tensors(taken=True)
        if promote:
            for loc in promote:
                self.fed[loc] = None
                self.guards.pop(loc, None)
            return True
        symbols = _data_dependent_symbols(exc)
        if not symbols or recorder is None:
            return False
        branched = {recorder.symbols[s] for s in symbols if s in recorder.symbols}
        if not branched and self._scalar_buffers and not self.item_reads:
            self.item_reads = True  # perhaps a buffer's .item(): the next trace names it
            return True
        # A number an optimizer keeps in a tensor (its step count; its siblings too), or a
        # hyperparameter read as its input's .item() (group["lr"]), that the trace branched
        # on (sub's alpha != 1 too): fed as a number from now on, so the branch is a guard.
        scalars = {s for loc in branched for s in getattr(loc, "siblings", ())}
        branched = {loc for loc in branched if not hasattr(loc, "siblings")}
        scalars |= {loc for loc in branched - self.pinned if _numeric(loc.get())}
        scalars -= set(self.fed)
        self.fed.update(dict.fromkeys(scalars))
        if scalars or not branched or branched <= self.pinned:
            return bool(scalars)
        for loc in branched:
            self.fed.pop(loc, None)
            self.pinned.add(loc)
        return True

    def _follow(self, modules: Sequence[Any], attributes: Sequence[tuple[Any, str]]) -> bool:
        """Modules whose Python attributes the body wrote (a torchmetrics ``Metric``'s
        ``self._update_count += 1``, ``self._computed = None``): from the next trace on,
        followed as a plain object's are (counters fed, writes replayed, scalars guarded).
        Those attributes of a module of the user's code (``self.calls += 1``), whose reads
        are recorded, leave the model's key (``unkeyed``). Whether one is new."""
        self.unkeyed.update((id(m), a) for m, a in attributes if is_user_code(type(m)))
        new = [m for m in modules if id(m) not in self._followed]
        for module in new:
            self._followed.add(id(module))
            label = next(
                ".".join(filter(None, [top_label, name]))
                for top_label, top in self._modules
                for name, sub in top.named_modules()
                if sub is module
            )
            self.roots.append(ModuleRoot(label, module))
        return bool(new)

    def finish(
        self,
        recorder: Recorder,
        fed: list[Location],
        branches: str | None = None,
        sites: Sequence[str] = (),
    ) -> PythonPlan:
        """After a successful trace: keep its guards and the condition on the fed numbers
        it branched on (``branches``, over ``t0, t1, ...`` in ``fed``'s order; made at
        ``sites`` of the user's code), and plan its Python side."""
        if branches:  # a number drawn from np.random or random: drawn ahead of each call
            drawn = [loc for loc in fed if isinstance(getattr(loc, "root", None), DrawRoot)]
            branched_on_draws(branches, recorder.symbolic_inputs, fed, drawn, sites)
        branch = self._branch_checks.get((branches, tuple(fed))) if branches else None
        if branches and branch is None:
            check = eval(f"lambda L: bool({branches})", dict(SYMPY_INTERP))
            # t0, t1, ...: the fed numbers, in order (the tracer's symbols; not tensors)
            numbers = [loc for loc in fed if not isinstance(recorder.symbolic_inputs[loc], Tensor)]
            text = re.sub(r"L\['t(\d+)'\]", lambda m: numbers[int(m[1])].label, branches)
            sites = [_site(site, self._fn) for site in sites]
            branch = self._branch_checks[(branches, tuple(fed))] = (check, numbers)
            self.branches.append((check, numbers, _branch_label(text, branches, numbers, sites)))
        self.loose.update(recorder.loose)
        for loc, value in recorder.guards.items():
            self.guards.setdefault(loc, None)
            self.traced_values[loc] = value
        plan = PythonPlan(fed=list(fed), seeds=list(recorder.seeds), effects=recorder.effects)
        plan.draws = list(self.draws.made)
        plan.conditions = Conditions(recorder.guards, fed, recorder.loose, branch)
        plan.n_outputs = len(recorder.outputs)
        for event in recorder.schedulers:
            stepped = recorder.steps_taken.get(id(getattr(event.scheduler, "optimizer", None)), 0)
            if event.position == stepped:
                event.phase = "after"
            elif event.position == 0:
                event.phase = "before"
                if any(t[0] != "const" for t in [*event.args, *event.kwargs.values()]):
                    raise TraceError(
                        f"the step calls {type(event.scheduler).__name__}.{event.method}(...) "
                        "before the optimizer's step with an argument computed in the step; "
                        "functacc.jit runs that scheduler step before the graph, where the "
                        "argument is not known yet. Fix: step the scheduler after opt.step()."
                    )
            else:
                raise TraceError(
                    f"the step calls {type(event.scheduler).__name__}.{event.method}() between two "
                    "steps of its optimizer; functacc.jit replays a scheduler step before or "
                    "after the graph. Fix: step the scheduler before or after every step of "
                    "its optimizer in the step."
                )
            (plan.before if event.phase == "before" else plan.after).append(event)
        return plan

    def generator_resets(
        self, plan: PythonPlan, graph: torch.fx.GraphModule, known: dict[int, tuple[Any, Tensor]]
    ) -> None:
        """The ``torch.Generator`` objects the graph draws from that the body seeded or
        made: each is put back to that state before every run (eager seeds it each call).
        ``known``: the generators that existed before the trace, with their states then."""
        for node in graph.graph.nodes:
            g = getattr(graph, node.target, None) if node.op == "get_attr" else None
            if not isinstance(g, torch.Generator):
                continue
            now = g.get_state()
            if generator_key(g) in known:
                before = known[generator_key(g)][1]
                if torch.equal(before, now):
                    plan.held.append(generator_key(g))
                    continue
                g.set_state(before)  # the trace seeded it: undo, the run replays it
            plan.generators.append((g, now))

    # -- around a run ----------------------------------------------------------------------
    def before_run(self, plan: PythonPlan) -> Replay:
        """Seeds, generator states and scheduler steps that come before the graph. The
        returned :class:`Replay` undoes them if the run fails, and does the rest after it."""
        if plan.empty:  # the common case: nothing to do around the graph, nothing to undo
            return QUIET
        replay = Replay(plan)
        if plan.seeds or plan.generators:
            replay.undo.rng()
        if plan.draws:  # NumPy's arrays the step draws: eager's, in its order (python_draws)
            replay.undo.host_generators(plan.draws)
            replay.drawn = draw_all(plan.draws)
        for g, state in plan.generators:
            replay.undo.generator(g)
            g.set_state(state)
        if plan.seeds:
            values = {loc: loc.get() for loc in plan.fed}
            for seed in plan.seeds:
                seed.function(seed.evaluate(values))
        for event in [*plan.before, *plan.after]:
            replay.lrs.setdefault(id(event.scheduler), [last_lrs(event.scheduler)])
        for event in plan.before:
            replay.undo.scheduler(event.scheduler)
            args = [build(a, (), {}) for a in event.args]  # constants: checked at the trace
            kwargs = {k: build(v, (), {}) for k, v in event.kwargs.items()}
            replay.lrs[id(event.scheduler)].append(event.run(args, kwargs))
        return replay


def _outside_tensor(exc: BaseException) -> bool:
    """Whether a trace failed on a real tensor that is none of its inputs."""
    return any("convert all Tensors to FakeTensors" in str(e) for e in (exc, exc.__cause__))


def _site(site: str, fn: Callable[..., Any]) -> str:
    """A branch's site (``utils.py:107 in format_time``), with the function the step calls
    toward it (``(via progress_bar)``), or said to be the step's own code."""
    name = site.rsplit(" in ", 1)[-1]
    if name == getattr(getattr(fn, "__func__", fn), "__name__", None):
        return f"{site} (the step)"
    via = called_toward(fn, name)
    if not result_unused(fn, via or name):  # not for functacc.host: lr = get_lr(it)
        return f"{site} (result used by the step)"
    return f"{site} (via {via})" if via and via != name else site


def _branch_label(text: str, branches: str, numbers: list[Location], sites: Sequence[str]) -> str:
    """How a retrace names a trace's branches on fed numbers: the condition, or where it
    is long (a progress bar's arithmetic on the clock), the numbers and the lines."""
    at = f" at {', '.join(sites[:3])}{' ...' if len(sites) > 3 else ''}" if sites else ""
    if len(text) <= 200:
        return f"branch on fed numbers {text}{at}"
    used = dict.fromkeys(numbers[int(i)].label for i in re.findall(r"L\['t(\d+)'\]", branches))
    return f"branch on fed numbers {', '.join(used)}{at}"


def generator_key(g: torch.Generator) -> int:
    """Which generator ``g`` is: the traced graph holds another Python object around the
    same C++ generator as the module's, so the object's ``id`` would not match it."""
    return getattr(g, "_cdata", id(g))


def _numeric(value: Any) -> bool:
    """A number fed to the graph when it changes: Python's, NumPy's int64 and float64 (a
    count kept with np.sum: a float64 is a float; int64 arithmetic is int's)."""
    return isinstance(value, NUMBERS) and not isinstance(value, bool)


def _as_input(value: Any) -> int | float | Tensor:
    if isinstance(value, Tensor):  # a tensor read from the Python state (python_tensors)
        return value
    if not _numeric(value):
        raise TypeError(f"a fed Python value must be an int or a float; got {value!r}")
    return float(value) if isinstance(value, float) else int(value)  # np.float64: a float


def _data_dependent_symbols(exc: BaseException) -> set:
    """The symbols of the fed values a failed trace branched on."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cond = getattr(exc, "cond", None)
        if cond is not None and hasattr(cond, "free_symbols"):
            return set(cond.free_symbols)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return set()
