"""While a step body is traced: what it reads and writes in Python, noted as it happens.

:class:`Recorder` is entered around one trace of the body (``PythonState.scope``). It

- installs the values of *symbolic* locations (counters the body writes) as the ``.item()``
  of a 0-dim graph input each, so that ``self.step += 1`` traces to ``u0 + 1``, a value the
  graph computes on every call;
- notes every scalar the body reads from a location that stays baked in (a *guard*) and
  every write, an :class:`~.python_effects.Effect` replayed after each call;
- swaps each optimizer's ``param_groups`` entries for recording dicts: a body that reads
  ``group["lr"]`` gets the learning rate fed to the graph, one that assigns it changes the
  ``opt.step()`` that follows;
- stands in for ``lr_scheduler.step()`` (run before or after the graph) and for
  ``torch.manual_seed`` (before the graph); puts every location back, whatever happened.
"""

from __future__ import annotations

import functools
import io
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import SymBool, SymFloat, SymInt, Tensor

from ..errors import TraceError
from .drawn_arrays import DrawnArray, drawn_template
from .lookup_tables import install_tables
from .python_effects import Effect, LastLR, SchedulerEvent, Seed, Template
from .python_files import noting_files
from .python_lists import RecordingDeque, RecordingList, list_writes, took_list
from .python_location import MISSING, Location, Root, fields_of
from .python_made import made_template
from .python_numbers import unstood
from .python_numpy import NUMBERS, TracedArray, new_number, numpy_template
from .python_output import output_template, patch_output
from .python_reach import held, holds_traced, plain_objects
from .python_recording import ACTIVE, RecordingDict, RecordingGroup, groups_root, recording, shared
from .python_sets import STEPPERS, SetWatch, is_guarded, refuse_made_in_step
from .python_tensors import FedRequiringGrad, install_held, installed, tensor_locations

__all__ = ["Recorder", "Retry"]

_SYM = (SymInt, SymFloat, SymBool)


class Retry(Exception):
    """Trace again: locations the body writes became symbolic (``promote``)."""

    _functacc_user_error = True  # passed through the tracer as it is

    def __init__(self, promote: list[Location]):
        super().__init__([loc.label for loc in promote])
        self.promote = promote


class Recorder:
    """One trace's view of the body's Python state (see the module docstring)."""

    def __init__(
        self,
        roots: Sequence[Root],
        symbolic: dict[Location, Tensor],
        optimizers: Sequence[Any],
        pinned: set[Location],
        owned: set[int],
    ):
        self.roots = list(roots)
        self.owned = owned  # ids of the step's own tensors (python_tensors.feedable)
        self.tensor_reads: dict[Location, None] = {}  # tensors read, to feed
        self.loose: dict[Location, Tensor] = {}  # where optimizer-only tensors are held
        self.symbolic_inputs, self.pinned = symbolic, pinned
        self.optimizers = list(optimizers)  # LinkedOptimizer
        self.recording = False
        self.guards: dict[Location, Any] = {}
        self.symbols: dict[Any, Location] = {}  # sympy symbol of a fed value -> location
        self.outputs: list[Tensor | SymInt | SymFloat | SymBool] = []
        self.effects: list[Effect] = []
        self.made: dict[int, Template | None] = {}  # id(value) -> its template (python_made)
        self.rendered: dict[str, str] = {}  # a '%' stand-in's text -> its token (python_percent)
        self.schedulers: list[SchedulerEvent] = []
        self.seeds: list[Seed] = []
        self.steps_taken: dict[int, int] = {}  # id(optimizer) -> opt.step() calls so far
        self.hyper: dict[tuple[int, int], dict[str, Tensor]] = {}  # (opt, group) -> inputs
        self._read_first: set[tuple[int, str]] = set()
        self._written: set[tuple[int, str]] = set()
        self._undo: list[Callable[[], None]] = []
        self._originals: dict[int, Any] = {}  # id(recording copy) -> the dict it stands for
        self._unrecorded: set[int] = set()  # objects whose class could not be swapped

    # -- entering and leaving --------------------------------------------------------------
    def __enter__(self) -> Recorder:
        try:
            self._enter()
        except BaseException:
            self._restore()
            raise
        return self

    def _enter(self) -> None:
        self.objects = plain_objects(self.roots)
        self.snapshots: list[tuple[Location, Any, Any]] = []  # (location, object, contents)
        self.root_values = [(r, r.get()) for r in self.roots]
        self._undo.append(self._put_roots_back)
        self.variables = [(Location(root), value) for root, value in self.root_values]
        self.sets = SetWatch(held(self.variables, self.objects.values(), set))  # seen.add()
        self._undo.append(self.sets.restore)
        # Optimizers' and schedulers' attributes the body writes (opt.my_count += 1): unguarded.
        steppers = held(self.variables, self.objects.values(), STEPPERS)
        for location, obj in {id(o): (loc, o) for loc, o in reversed(steppers)}.values():
            self.snapshots.append((location, obj, dict(vars(obj))))
            self._unrecorded.add(id(obj))
        install_tables(self)  # lr_schedule[it], hist[epoch] = loss.item()
        elsewhere = shared(self.root_values, self.objects)
        for location, obj in self.objects.values():
            if type(obj) in (dict, defaultdict) or isinstance(obj, (list, deque)):
                kind = {dict: RecordingDict, defaultdict: RecordingDict, list: RecordingList}
                copy = kind.get(type(obj), RecordingDeque)(obj, location, self)
                self._originals[id(copy)] = obj
                for place in [location, *elsewhere.get(id(obj), ())]:  # a hook's cell too
                    place.set(copy)  # the body reads and writes the copy while traced
                    self._undo.append(lambda place=place, obj=obj: place.set(obj))
                self.snapshots.append(
                    (location, copy, dict(obj) if isinstance(obj, dict) else list(obj))
                )
            else:  # an object, or a dict of a class of its own (a Counter, an OrderedDict)
                fields = obj if isinstance(obj, dict) else fields_of(obj)
                # What it held (a dict root of its own is a recording copy by now).
                self.snapshots.append(
                    (location, obj, {k: self._original(v) for k, v in fields.items()})
                )
                stop = None if isinstance(obj, dict) else recording(obj)
                if stop is not None:
                    self._undo.append(stop)
                else:  # its reads cannot be seen: every scalar it holds is guarded
                    self._unrecorded.add(id(obj))
                    kind = "item" if isinstance(obj, dict) else "attr"
                    for k, v in fields.items():
                        if not (kind == "attr" and k.startswith("__")):  # a class's __doc__
                            self.guard(location.child(kind, k), v)
                    if isinstance(obj, dict):  # and which keys it has (a Counter's 0s)
                        self.guard(location.child("keys", None), tuple(obj))
        self._undo.append(self._put_contents_back)
        # Variables are read without a trace of it: the scalars the body's code loads are
        # guarded (objects' attributes and dicts' entries: only those it reads).
        for root, value in self.root_values:
            if root.loaded:
                self.guard(Location(root), value)
                self.note_tensors(Location(root), value)
        self.requiring_grad = FedRequiringGrad(self.symbolic_inputs)  # an EMA's deepcopy
        for location, value in self.symbolic_inputs.items():  # a fed number: its symbol
            if not isinstance(value, Tensor):
                self.symbols[value.node.expr] = location
            if not _external(location):  # an optimizer's are given by its traced step
                installed(location, value, self._originals)
        for k, linked in enumerate(self.optimizers):
            opt = linked.optimizer
            originals = list(opt.param_groups)
            root = groups_root(linked)
            opt.param_groups[:] = [
                RecordingGroup(g, Location(root, (("item", i),)), self, (k, i))
                for i, g in enumerate(originals)
            ]
            self._undo.append(
                functools.partial(opt.param_groups.__setitem__, slice(None), originals)
            )
        from .python_effects import patch_random_and_schedulers

        self._undo.append(patch_random_and_schedulers(self))
        self._undo.append(patch_output(self))
        files = held(self.variables, self.objects.values(), io.IOBase)  # log.write(f"...")
        self._undo.append(noting_files(files, self, self._originals))
        ACTIVE.append(self)
        self._undo.append(ACTIVE.pop)
        self.recording = True
        unfed = self.unfed_tensors()  # a variable's (read as soon as the body runs)
        if unfed:
            raise Retry(unfed)

    def finish(self) -> None:
        """After the body returned: every write, collected as an effect. Raises
        :class:`Retry` where counters must be fed to the graph first."""
        self.recording = False
        self.requiring_grad.check()
        self.sets.check()
        self.arrays.check()
        promote = self._collect_writes() + self.unfed_tensors()
        if promote:
            raise Retry(promote)

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        self.recording = False
        while self._undo:
            self._undo.pop()()

    def _put_roots_back(self) -> None:
        for root, value in self.root_values:
            if root.get() is not value:
                root.set(value)

    def _put_contents_back(self) -> None:
        for _, obj, contents in self.snapshots:
            if isinstance(obj, (list, deque)):  # recording copies, dropped
                continue
            fields = obj if isinstance(obj, dict) else fields_of(obj)
            for key in [k for k in fields if k not in contents]:
                del fields[key]
            for key, value in contents.items():
                if fields.get(key, MISSING) is not value:
                    fields[key] = value

    # -- reads -----------------------------------------------------------------------------
    def read(self, obj: Any, name: str, value: Any) -> None:
        """A recording object's attribute was read."""
        if not self.recording or (id(obj), name) in self._written or id(obj) not in self.objects:
            return  # (not reached from the roots: a copy.copy() made in the step)
        if name not in fields_of(obj):
            return  # a method or a class attribute: code, not state
        self._read_first.add((id(obj), name))
        if isinstance(value, RecordingList):
            value.taken = True
        if is_guarded(value):
            self.guard(self.objects[id(obj)][0].child("attr", name), value)
        elif isinstance(value, (Tensor, tuple)):
            self.note_tensors(self.objects[id(obj)][0].child("attr", name), value)

    def item_read(self, mapping: RecordingDict, key: Any, value: Any) -> None:
        """A recording dict's entry was read."""
        self._read_first.add((id(mapping), key))
        if isinstance(value, RecordingList):
            value.taken = True
        self.guard(mapping.location.child("item", key), value)
        if self.note_tensors(mapping.location.child("item", key), value, False):
            self._note_all(mapping.location.child, dict.items(mapping))

    def note_tensors(self, location: Location, value: Any, stop: bool = True) -> list:
        """The body reads ``value`` at ``location``: a tensor there not fed yet stops the
        trace at once (:class:`Retry` feeds it), before the body can update it in place."""
        new = [loc for loc in tensor_locations(location, value, self.owned)]
        new = [loc for loc in new if loc not in self.symbolic_inputs]
        self.tensor_reads.update(dict.fromkeys(new))
        if new and self.recording and stop:
            raise Retry(new)
        return new

    def install_held(self, leaves: dict[int, Tensor]) -> None:
        """The traced tensor for each of the step's own (``leaves``, by id) where the body's
        variables and plain objects hold it (:func:`~.python_tensors.install_held`), and as
        a dict's key (``slow[p]``: :class:`RecordingDict` looks it up by the parameter)."""
        recording, self.recording, self.stand_in = self.recording, False, leaves
        found = held(self.variables, self.objects.values(), (Tensor, tuple))
        self.loose.update(install_held(found, leaves, self._originals))
        self.recording = recording

    def list_read(self, lst: RecordingList | RecordingDeque) -> None:
        items = lst.before if isinstance(lst, RecordingDeque) else list(list.__iter__(lst))
        self._note_all(lst.location.child, enumerate(items))

    def _note_all(self, at: Callable, pairs: Any) -> None:
        """The tensors of a list or dict the body read, all at once (an EMA's shadow tensors,
        {name: tensor}), not one per trace."""
        new = [x for k, v in pairs for x in self.note_tensors(at("item", k), v, False)]
        if new and self.recording:
            raise Retry(new)

    def unfed_tensors(self, taken: bool = False) -> list[Location]:
        """The tensors the body read from its Python state that are not fed yet (the
        items of a list it read too; with ``taken``, of a list it took, which torch's C++
        may have read unseen: after a trace that failed on a tensor not its input)."""
        for location, obj, contents in self.snapshots:
            took = taken and isinstance(obj, RecordingList) and took_list(obj, self._unrecorded)
            if isinstance(obj, (RecordingList, RecordingDeque)) and (obj.read or took):
                for i, value in enumerate(contents):  # all of them (not one per trace)
                    self.note_tensors(location.child("item", i), value, False)
        return [loc for loc in self.tensor_reads if loc not in self.symbolic_inputs]

    def guard(self, location: Location, value: Any) -> None:
        if is_guarded(value) and location not in self.symbolic_inputs:
            self.guards.setdefault(location, value)

    # -- writes ----------------------------------------------------------------------------
    def write(self, obj: Any, name: str) -> None:
        """A recording object's attribute was assigned or deleted."""
        if self.recording:
            self._written.add((id(obj), name))

    def template(self, value: Any, where: str) -> Template:
        """How to produce ``value`` after each call: a constant, a graph output, a container
        of those, or a scheduler's learning rate."""
        if isinstance(value, Tensor):
            self.outputs.append(value.detach())
            return ("out", len(self.outputs) - 1)
        if isinstance(value, _SYM):
            self.outputs.append(value)
            return ("out", len(self.outputs) - 1)
        if isinstance(value, LastLR):
            return ("lr", value)
        if isinstance(value, (TracedArray, DrawnArray)):  # an array, made after each call
            make = numpy_template if isinstance(value, TracedArray) else drawn_template
            return make(value, lambda t: self.template(t, where))
        made = output_template(value, lambda v: self.template(v, where), self.rendered)
        if made is not None:  # a formatted string or path, a state_dict()
            return made
        made = made_template(value, lambda v: self.template(v, where), self.objects, self.made)
        if made is not None:  # a container, an object the step made (a meter)
            return made
        if holds_traced(value):
            raise TraceError(
                f"{where} holds {type(value).__name__} object made while tracing, with traced "
                "values inside, which functacc.jit cannot make again after each call (a "
                "library's object). Fix: make it before the step's first call (what the step "
                "writes into it is replayed), or return the values and build it after the call."
            )
        refuse_made_in_step(value, where, self)
        return ("const", unstood(value))

    def _collect_writes(self) -> list[Location]:
        promote: list[Location] = []
        for location, obj, contents in self.snapshots:
            if isinstance(obj, (list, deque)):
                effect, read = list_writes(
                    obj, location, contents, self.symbolic_inputs, self._original,
                    self.template, self._unrecorded,
                )  # fmt: skip
                if effect is not None:
                    self.effects.append(effect)
                if read:  # (by torch's C++ too) its length and numbers: signature; tensors: fed
                    self.guard(location.child("len", None), len(contents))
                    for i, value in enumerate(contents):
                        self.guard(location.child("item", i), value)
                        promote += self.note_tensors(location.child("item", i), value, False)
                continue
            fields = obj if isinstance(obj, dict) else fields_of(obj)
            keys = list(contents) + [k for k in fields if k not in contents]
            for key in keys:
                new, old = self._original(fields.get(key, MISSING)), contents.get(key, MISSING)
                written = (id(obj), key) in self._written or key in getattr(obj, "written", ())
                kind = "item" if isinstance(obj, dict) else "attr"
                target = location.child(kind, key)
                if new is old and (not written or isinstance(old, (Tensor, tuple))):
                    continue  # a fed tensor updated in place is written into it by the graph
                if self._promotes(target, old, new, (id(obj), key), id(obj) in self._unrecorded):
                    promote.append(target)
                self.effects.append(Effect.assign(target, new, self.template, where=target.label))
        for root, old in self.root_values:
            new = self._original(root.get())
            if new is not old:
                target = Location(root)
                if self._promotes(target, old, new, None, True):
                    promote.append(target)
                self.effects.append(Effect.assign(target, new, self.template, where=target.label))
        for linked in self.optimizers:
            for group in linked.optimizer.param_groups:
                for key in sorted(group.written, key=str):
                    target = group.location.child("item", key)
                    new = dict.get(group, key, MISSING)
                    old = group.original.get(key, MISSING)
                    if self._promotes(target, old, new, (id(group), key), False):
                        promote.append(target)  # a counter in param_groups (group["step"])
                    self.effects.append(
                        Effect.assign(target, new, self.template, where=target.label)
                    )
        return promote

    def _original(self, value: Any) -> Any:
        """The dict a recording copy stands for (the copy itself is no new value)."""
        return self._originals.get(id(value), value)

    def _promotes(
        self, target: Location, old: Any, new: Any, key: tuple | None, always: bool
    ) -> bool:
        """A counter (a number the body reads and then writes) is traced symbolically."""
        if target in self.symbolic_inputs or target in self.pinned:
            return False
        if isinstance(old, bool) or isinstance(new, bool) or not isinstance(old, NUMBERS):
            return False
        return new_number(new) and (always or key in self._read_first)

    # -- optimizers, schedulers and seeds ------------------------------------------------------
    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``opt.step()`` ran (for the position of scheduler steps)."""
        self.steps_taken[id(optimizer)] = self.steps_taken.get(id(optimizer), 0) + 1

    def overrides(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Per param group, the hyperparameters the body assigned before this
        ``opt.step()`` (their new values, which that step uses)."""
        return [
            {k: dict.__getitem__(g, k) for k in getattr(g, "written", set()) if k in g}
            for g in optimizer.param_groups
        ]


def _external(location: Any) -> bool:
    root = getattr(location, "root", None)
    return root is None or root.external
