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

A number fed to the graph that the body branches on (``if self.step % 100 == 0``) stops
being fed and is guarded from then on (each new value retraces).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import TraceError
from .lookup_tables import table_key, table_repr
from .python_effects import SchedulerEvent, Seed, build
from .python_reach import MISSING, Location, Root, find_roots
from .python_trace import Recorder, Retry, groups_root

__all__ = ["Exact", "PythonPlan", "PythonState", "Replay", "Retry", "generator_key"]


class Exact:
    """A guarded value in a signature key: equal only to the same type and value (``1``,
    ``1.0`` and ``True`` differ; ``nan`` equals ``nan``)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any):
        self.value = value
        if isinstance(value, float) and math.isnan(value):
            self._key: Any = (float, "nan")
        elif isinstance(value, tuple):
            self._key = (tuple, tuple(Exact(v) for v in value))
        elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):  # a table
            self._key = table_key(value)
        else:
            self._key = (type(value), value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Exact) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:  # an array: its contents when keyed (it may change in place)
        return table_repr(self._key) or repr(self.value)


@dataclass
class PythonPlan:
    """One program's Python side: what runs before its graph and what after."""

    fed: list[Location] = field(default_factory=list)  # the graph's Python inputs, in order
    seeds: list[Seed] = field(default_factory=list)
    generators: list[tuple[torch.Generator, Tensor]] = field(default_factory=list)
    before: list[SchedulerEvent] = field(default_factory=list)
    after: list[SchedulerEvent] = field(default_factory=list)
    effects: list[tuple] = field(default_factory=list)
    n_outputs: int = 0

    @property
    def empty(self) -> bool:
        return not (self.seeds or self.generators or self.before or self.after or self.effects)

    def signature(self) -> tuple:
        """What a graph reused for another signature must share: its Python inputs and
        outputs, and the states it resets its generators to."""
        generators = tuple(hash(state.numpy().tobytes()) for _, state in self.generators)
        return (tuple(loc.label for loc in self.fed), self.n_outputs, generators)

    def rebind(self, compiled: PythonPlan) -> None:
        """This plan runs a graph compiled for ``compiled``'s trace: reset the generators
        that graph holds (the same states, other objects)."""
        self.generators = [
            (g, state)
            for (g, _), (_, state) in zip(compiled.generators, self.generators, strict=True)
        ]


class PythonState:
    """The Python state of one jitted body, across its traces and calls."""

    def __init__(self, fn: Callable[..., Any], optimizers: Sequence[Any]):
        self.roots: list[Root] = find_roots(fn)
        self.optimizers = list(optimizers)  # LinkedOptimizer
        self.guards: dict[Location, None] = {}  # over every trace so far, in order
        self.fed: dict[Location, None] = {}
        self.pinned: set[Location] = set()  # fed once, but branched on: guarded for good
        self.traced_values: dict[Location, Any] = {}
        self._recorder: Recorder | None = None
        # Per trace with fed numbers it branched on: that condition, over the fed locations.
        self.branches: list[tuple[Callable[[dict], bool], list[Location]]] = []
        self._branch_keys: set[tuple] = set()

    # -- per call ------------------------------------------------------------------------
    def key(self) -> tuple:
        """The part of the signature the body's Python reads: the guarded values and the
        types of the fed ones."""
        if not self.guards and not self.fed:
            return ()
        guarded = tuple((loc.label, Exact(loc.get())) for loc in self.guards)
        fed = tuple((loc.label, ("fed", type(loc.get()).__name__)) for loc in self.fed)
        if not self.branches:
            return guarded + fed
        # Each trace's branches on fed numbers (if self.step % 100 == 0): which hold now.
        held = tuple(
            check({f"t{i}": loc.get() for i, loc in enumerate(locs)})
            for check, locs in self.branches
        )
        return (*guarded, *fed, ("branches on fed numbers", held))

    def inputs(self, plan: PythonPlan | None = None) -> list[int | float]:
        """The fed values now: the graph's Python-number inputs."""
        return [_as_input(loc.get()) for loc in (plan.fed if plan is not None else self.fed)]

    # -- tracing -------------------------------------------------------------------------
    def prepare(self) -> list[Location]:
        """Before a trace: numbers whose guarded value changed since an earlier trace are
        fed from now on (automatic dynamic); fed values that are no longer numbers are not."""
        for loc in list(self.guards):
            value, before = loc.get(), self.traced_values.get(loc, MISSING)
            if loc not in self.pinned and _numeric(value) and _numeric(before) and value != before:
                del self.guards[loc]
                self.fed[loc] = None
        for linked in self.optimizers:  # an optimizer traced whole: its numbers are fed
            numbers = getattr(linked, "numbers", None)
            for loc in numbers(groups_root(linked)) if numbers is not None else ():
                if loc not in self.pinned:
                    self.fed.setdefault(loc, None)
                    self.guards.pop(loc, None)
        for loc in list(self.fed):
            if not _numeric(loc.get()):
                del self.fed[loc]
                self.pinned.add(loc)
        return list(self.fed)

    @contextlib.contextmanager
    def scope(self, fed: Sequence[Location], placeholders: Sequence[Tensor]) -> Iterator[Recorder]:
        recorder = Recorder(
            self.roots, dict(zip(fed, placeholders, strict=True)), self.optimizers, self.pinned
        )
        self._recorder = recorder
        with recorder:
            yield recorder

    def retry(self, exc: BaseException) -> bool:
        """After a failed trace: whether tracing again can succeed — counters to feed
        (:class:`Retry`), or fed values the body branched on, to guard instead."""
        if isinstance(exc, Retry):
            for loc in exc.promote:
                self.fed[loc] = None
                self.guards.pop(loc, None)
            return True
        symbols = _data_dependent_symbols(exc)
        recorder = self._recorder
        if not symbols or recorder is None:
            return False
        branched = {recorder.symbols[s] for s in symbols if s in recorder.symbols}
        # A number an optimizer keeps in a tensor (its step count) that its step() branches
        # on: fed from now on as a number (its siblings too), so the branch is a guard.
        scalars = {s for loc in branched for s in getattr(loc, "siblings", ())} - set(self.fed)
        for loc in scalars:
            self.fed[loc] = None
        branched = {loc for loc in branched if not hasattr(loc, "siblings")}
        if scalars:
            return True
        if not branched or branched <= self.pinned:
            return False
        for loc in branched:
            self.fed.pop(loc, None)
            self.pinned.add(loc)
        return True

    def finish(
        self, recorder: Recorder, fed: list[Location], branches: str | None = None
    ) -> PythonPlan:
        """After a successful trace: keep its guards and the condition on the fed numbers
        it branched on (``branches``, over ``t0, t1, ...`` in ``fed``'s order), and plan its
        Python side."""
        if branches and (branches, tuple(fed)) not in self._branch_keys:
            from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

            self._branch_keys.add((branches, tuple(fed)))
            check = eval(f"lambda L: bool({branches})", dict(SYMPY_INTERP))
            self.branches.append((check, list(fed)))
        for loc, value in recorder.guards.items():
            self.guards.setdefault(loc, None)
            self.traced_values[loc] = value
        plan = PythonPlan(fed=list(fed), seeds=list(recorder.seeds), effects=recorder.effects)
        plan.n_outputs = len(recorder.outputs)
        for event in recorder.schedulers:
            stepped = recorder.steps_taken.get(id(getattr(event.scheduler, "optimizer", None)), 0)
            if event.position == stepped:
                event.phase = "after"
            elif event.position == 0:
                event.phase = "before"
                if any(t[0] != "const" for t in [*event.args, *event.kwargs.values()]):
                    raise TraceError(
                        f"the step calls {type(event.scheduler).__name__}.step(...) before "
                        "the optimizer's step with an argument computed in the step; "
                        "functacc.jit runs that scheduler step before the graph, where the "
                        "argument is not known yet. Fix: step the scheduler after opt.step()."
                    )
            else:
                raise TraceError(
                    f"the step calls {type(event.scheduler).__name__}.step() between two "
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
                    continue
                g.set_state(before)  # the trace seeded it: undo, the run replays it
            plan.generators.append((g, now))

    # -- around a run ----------------------------------------------------------------------
    def before_run(self, plan: PythonPlan) -> Replay:
        """Seeds, generator states and scheduler steps that come before the graph. The
        returned :class:`Replay` undoes them if the run fails, and does the rest after it."""
        if plan.empty:  # the common case: nothing to do around the graph, nothing to undo
            return _QUIET
        replay = Replay(plan)
        if plan.seeds or plan.generators:
            replay.undo.rng()
        for g, state in plan.generators:
            replay.undo.generator(g)
            g.set_state(state)
        if plan.seeds:
            values = {loc: loc.get() for loc in plan.fed}
            for seed in plan.seeds:
                seed.function(seed.evaluate(values))
        for event in [*plan.before, *plan.after]:
            replay.lrs.setdefault(id(event.scheduler), [list(event.scheduler.get_last_lr())])
        for event in plan.before:
            replay.undo.scheduler(event.scheduler)
            event.scheduler.step(*[build(a, (), {}) for a in event.args])
            replay.lrs[id(event.scheduler)].append(list(event.scheduler.get_last_lr()))
        return replay


def generator_key(g: torch.Generator) -> int:
    """Which generator ``g`` is: the traced graph holds another Python object around the
    same C++ generator as the module's, so the object's ``id`` would not match it."""
    return getattr(g, "_cdata", id(g))


class Replay:
    """One call's Python side around its graph (:meth:`PythonState.before_run`)."""

    def __init__(self, plan: PythonPlan):
        self.plan = plan
        self.undo = _Undo()
        self.lrs: dict[int, list[list[float]]] = {}  # id(scheduler) -> lr after k steps

    @property
    def changed(self) -> bool:
        """Whether something ran before the graph (optimizer hyperparameters may differ)."""
        return bool(self.plan.before)

    def after(self, outputs: Sequence[Any]) -> None:
        """Scheduler steps and writes after a successful run: a group's entries first (a
        body assigns them before stepping), then the schedulers, then everything else."""
        plan, lrs = self.plan, self.lrs
        for effect in plan.effects:
            if effect[0] == "assign" and _is_group(effect[1]):
                effect[1].set(build(effect[2], outputs, lrs))
        for event in plan.after:
            args = [build(a, outputs, lrs) for a in event.args]
            kwargs = {k: build(v, outputs, lrs) for k, v in event.kwargs.items()}
            event.scheduler.step(*args, **kwargs)
            lrs[id(event.scheduler)].append(list(event.scheduler.get_last_lr()))
        for effect in plan.effects:
            kind, target = effect[0], effect[1]
            if kind == "assign" and not _is_group(target):
                target.set(build(effect[2], outputs, lrs))
            elif kind == "delete":
                target.delete()
            elif kind == "append":
                target.get().extend(build(t, outputs, lrs) for t in effect[2])
            elif kind == "call":  # print, logging, tqdm: with this call's values
                target(
                    *[build(t, outputs, lrs) for t in effect[2]],
                    **{k: build(t, outputs, lrs) for k, t in effect[3].items()},
                )


def _is_group(location: Location) -> bool:
    return location.root.label.endswith(".param_groups")


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_input(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
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


class _Undo:
    """Puts back what :meth:`PythonState.before_run` changed."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def rng(self) -> None:
        state = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._steps.append(lambda: _set_rng(state, cuda))

    def generator(self, g: torch.Generator) -> None:
        state = g.get_state()
        self._steps.append(lambda: g.set_state(state))

    def scheduler(self, scheduler: Any) -> None:
        import copy

        fields = copy.deepcopy({k: v for k, v in vars(scheduler).items() if k != "optimizer"})
        groups = copy.deepcopy(
            [
                {k: v for k, v in g.items() if k != "params"}
                for g in scheduler.optimizer.param_groups
            ]
        )

        def undo() -> None:
            vars(scheduler).update(fields)
            for g, saved in zip(scheduler.optimizer.param_groups, groups, strict=True):
                g.update(saved)

        self._steps.append(undo)

    def __call__(self) -> None:
        while self._steps:
            self._steps.pop()()


def _set_rng(state: Tensor, cuda: list[Tensor] | None) -> None:
    torch.set_rng_state(state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_QUIET = Replay(PythonPlan())  # the replay of every plan with nothing around its graph
