"""One call's Python side around its graph: what a jitted body's plan runs before the
graph (seeds, generator states, scheduler steps) and after it (scheduler steps, the writes
and calls it replays with the call's values), and how a failed run is undone.

:class:`PythonPlan` is made once per trace (:meth:`~.python_state.PythonState.finish`);
:class:`Replay` once per call (:meth:`~.python_state.PythonState.before_run`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .lookup_tables import table_key, table_repr
from .python_effects import SchedulerEvent, Seed, build
from .python_location import Location
from .python_sets import by_identity
from .python_tensors import fed_key

__all__ = ["QUIET", "Conditions", "Exact", "PythonPlan", "Replay"]


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
        elif isinstance(value, (set, frozenset)):
            self._key = (frozenset, frozenset(Exact(v) for v in value))
        elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):  # a table
            self._key = table_key(value)
        elif isinstance(value, Tensor):  # where a guarded value was: fed once read
            self._key = fed_key(value)
        elif by_identity(value):  # a module, an optimizer, a scheduler: this very object
            self._key = (type(value), id(value))  # (kept alive by self.value)
        else:
            self._key = (type(value), value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Exact) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:  # an array: its contents when keyed (it may change in place)
        if by_identity(self.value):  # not a whole model's repr
            return f"<{type(self.value).__name__} object at {id(self.value):#x}>"
        return table_repr(self._key) or repr(self.value)


class Conditions:
    """When a program's trace holds for a call: the values its Python read and baked in
    are equal (made after the trace, which leaves the state as the call found it), its fed
    values have the same types, the optimizer tensors it found loose
    are still there, and the numbers it branched on still take its branches. A later trace
    may read more (the other path of ``if need_update:``), which the signature then keys:
    a call whose signature is new may still be served by an earlier program."""

    def __init__(
        self,
        guards: Iterable[Location],
        fed: list[Location],
        loose: dict[Location, Tensor],
        branch: tuple[Callable[[dict], bool], list[Location]] | None,
    ):
        self.guards = [(loc, Exact(loc.get())) for loc in guards]
        self.fed = [(loc, fed_key(loc.get())) for loc in fed]
        self.loose, self.branch = list(loose.items()), branch

    def hold(self) -> bool:
        try:
            if any(Exact(loc.get()) != value for loc, value in self.guards):
                return False
            if any(fed_key(loc.get()) != kind for loc, kind in self.fed):
                return False
            if any(loc.get() is not t for loc, t in self.loose):
                return False
            if self.branch is None:
                return True
            check, numbers = self.branch
            return check({f"t{i}": x.get() for i, x in enumerate(numbers)})
        except Exception:  # a location gone (an attribute deleted): not this program
            return False


@dataclass
class PythonPlan:
    """One program's Python side: what runs before its graph and what after."""

    fed: list[Location] = field(default_factory=list)  # the graph's Python inputs, in order
    seeds: list[Seed] = field(default_factory=list)
    generators: list[tuple[torch.Generator, Tensor]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # generators it draws from as they are
    before: list[SchedulerEvent] = field(default_factory=list)
    after: list[SchedulerEvent] = field(default_factory=list)
    effects: list[tuple] = field(default_factory=list)
    n_outputs: int = 0
    conditions: Conditions | None = None  # when its trace holds for a call
    draws: list[Any] = field(default_factory=list)  # NumPy's, drawn before it (DrawRoot)

    @property
    def empty(self) -> bool:
        around = self.seeds or self.generators or self.before or self.after or self.effects
        return not (around or self.draws)

    def signature(self) -> tuple:
        """What a graph reused for another signature must share: its Python inputs and
        outputs, the states it resets its generators to, and the generators it draws from as
        they are (a graph holds them: another one there, a global replaced, is not it)."""
        generators = tuple(hash(state.numpy().tobytes()) for _, state in self.generators)
        return (tuple(loc.label for loc in self.fed), self.n_outputs, generators, *self.held)

    def rebind(self, compiled: PythonPlan) -> None:
        """This plan runs a graph compiled for ``compiled``'s trace: reset the generators
        that graph holds (the same states, other objects)."""
        self.generators = [
            (g, state)
            for (g, _), (_, state) in zip(compiled.generators, self.generators, strict=True)
        ]


class Replay:
    """One call's Python side around its graph (:meth:`PythonState.before_run`)."""

    def __init__(self, plan: PythonPlan):
        self.plan = plan
        self.undo = _Undo()
        self.lrs: dict[int, list[list[float]]] = {}  # id(scheduler) -> lr after k steps
        self.drawn: dict[Any, Tensor] = {}  # this call's NumPy arrays, by their DrawRoot

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
            lrs[id(event.scheduler)].append(event.run(args, kwargs))
        for effect in plan.effects:
            kind, target = effect[0], effect[1]
            if kind == "assign" and not _is_group(target):
                target.set(build(effect[2], outputs, lrs))
            elif kind == "delete":
                target.delete()
            elif kind == "append":
                target.get().extend(build(t, outputs, lrs) for t in effect[2])
            elif kind == "clear":
                target.get()[:] = [build(t, outputs, lrs) for t in effect[2]]
            elif kind == "call":  # print, logging, tqdm: with this call's values
                target(
                    *[build(t, outputs, lrs) for t in effect[2]],
                    **{k: build(t, outputs, lrs) for k, t in effect[3].items()},
                )


def _is_group(location: Location) -> bool:
    return location.root.label.endswith(".param_groups")


class _Undo:
    """Puts back what :meth:`PythonState.before_run` changed."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def rng(self) -> None:
        state = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._steps.append(lambda: _set_rng(state, cuda))

    def host_generators(self, draws: Sequence[Any] = ()) -> None:
        """NumPy's and Python's global generators, and the generator objects ``draws`` (the
        plan's, :class:`~.python_draws.DrawRoot`) draw from, which they advance."""
        import random

        import numpy as np

        from .watches import _generator_state, _set_generator_state

        states = np.random.get_state(), random.getstate()
        self._steps.append(lambda: (np.random.set_state(states[0]), random.setstate(states[1])))
        objects = {id(g): g for g in (d.source() for d in draws if not d.global_generator)}
        for g in objects.values():
            state = _generator_state(g)
            self._steps.append(lambda g=g, state=state: _set_generator_state(g, state))

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


QUIET = Replay(PythonPlan())  # the replay of every plan with nothing around its graph
