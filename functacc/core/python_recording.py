"""Objects and dicts that note what a step body reads and writes while it is traced.

- A plain object reached by the body (a trainer, a config) has its class swapped, for the
  trace, for a subclass that reports every attribute read and write to the active
  :class:`~.python_trace.Recorder` (:func:`recording`), and put back afterwards.
- A dict reached by the body is replaced, for the trace, by a :class:`RecordingDict` copy
  that reports the entries read and written; an optimizer's param groups by
  :class:`RecordingGroup`, whose numeric hyperparameters read as the values fed to the
  graph.

Example:
    >>> class Config:
    ...     pass
    >>> config = Config()
    >>> stop = recording(config)
    >>> type(config).__name__, isinstance(config, Config)
    ('Config', True)
    >>> stop()
    >>> type(config) is Config
    True
"""

from __future__ import annotations

import abc
import inspect
import os
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import Tensor

from .python_location import Location, Root, fields_of

__all__ = [
    "ACTIVE",
    "RecordingDict",
    "RecordingGroup",
    "groups_root",
    "recording",
    "shared",
]


class _Recorder:
    """What a recording object reports to (set while a body is traced)."""

    def read(self, obj: Any, name: str, value: Any) -> None: ...

    def write(self, obj: Any, name: str) -> None: ...


ACTIVE: list[_Recorder] = []  # the recorder of the trace in progress (one at a time)
_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    sub = _RECORDING_CLASSES.get(cls)
    if sub is not None:
        return sub
    if type(cls) not in (type, abc.ABCMeta) or inspect.ismethod(cls.__init_subclass__):
        # A metaclass or an __init_subclass__ of the user's own could react to a new
        # subclass (a registry): such objects are not swapped (their scalars are all
        # guarded instead, see python_trace.Recorder).
        _RECORDING_CLASSES[cls] = cls
        return cls

    def __getattribute__(self: Any, name: str) -> Any:
        value = super(sub, self).__getattribute__(name)
        if ACTIVE and not name.startswith("__"):
            value = ACTIVE[-1].arrays.view(value)  # self.hist[i] = v: made after each call
            ACTIVE[-1].read(self, name, value)
        elif ACTIVE and name == "__dict__" and _users(sys._getframe(1)):
            _read_all(self, value)  # vars(args), args.__dict__: every attribute read
        return value

    def __reduce_ex__(self: Any, protocol: Any) -> Any:  # copy.copy(cfg): C reads its dict
        if ACTIVE and not _functaccs(sys._getframe(1)):
            _read_all(self, fields_of(self))
        return super(sub, self).__reduce_ex__(protocol)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if ACTIVE:
            ACTIVE[-1].write(self, name)
        super(sub, self).__setattr__(name, value)

    def __delattr__(self: Any, name: str) -> None:
        if ACTIVE:
            ACTIVE[-1].write(self, name)
        super(sub, self).__delattr__(name)

    namespace = {
        "__slots__": (),
        "__getattribute__": __getattribute__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    try:
        sub = type(cls)(cls.__name__, (cls,), namespace)
    except TypeError:  # a final class, or a metaclass that refuses
        sub = cls
    _RECORDING_CLASSES[cls] = sub
    return sub


_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_all(obj: Any, fields: dict) -> None:
    for key, item in list(fields.items()):
        ACTIVE[-1].read(obj, key, item)


def _users(frame: Any) -> bool:
    """Whether ``frame`` runs the user's code (not a library's: nn.Module.__setattr__
    reads its table at every assignment)."""
    from .python_output import is_user_code

    return is_user_code(frame.f_code.co_filename)


def _functaccs(frame: Any) -> bool:
    """Whether ``frame`` runs functacc's own code (which reads objects' tables itself)."""
    return frame.f_code.co_filename.startswith(_OWN_CODE)


def recording(obj: Any) -> Callable[[], None] | None:
    """Make ``obj`` report its attribute reads and writes to the active recorder; returns
    the function that stops it (``None``: this object's class cannot be swapped)."""
    cls = type(obj)
    if isinstance(obj, type):  # a class: its attributes are compared after the trace
        return None
    sub = _recording_class(cls)
    if sub is cls:
        return None
    try:
        obj.__class__ = sub
    except (TypeError, AttributeError):  # __slots__ layouts, a frozen dataclass (its
        return None  # FrozenInstanceError), a class that forbids __class__ assignment

    def stop() -> None:
        object.__setattr__(obj, "__class__", cls)

    return stop


class RecordingDict(dict):
    """A dict the body reaches, while it is traced: a copy that notes which entries the
    body reads (scalars read are guarded) and writes (replayed after each call)."""

    def __init__(self, original: dict, location: Location, recorder: Any):
        super().__init__(original)
        self.original = original
        self.location = location
        self.recorder = recorder
        self.written: set[Any] = set()

    def _read(self, key: Any) -> Any:
        key = _known_key(self, key)
        value = self.recorder.arrays.view(dict.__getitem__(self, key))
        if self.recorder.recording and key not in self.written:
            self.recorder.item_read(self, key, value)
        return value

    def __getitem__(self, key: Any) -> Any:
        return self._read(key)

    def _absent(self, key: Any) -> None:
        """The body found ``key`` absent: a call that finds it present traces again."""
        key = _known_key(self, key)
        if self.recorder.recording and key not in self.written:
            self.recorder.guard(self.location.child("has", key), False)

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, _known_key(self, key)):
            return self._read(key)
        self._absent(key)
        return default

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, _known_key(self, key)):
            self._read(key)
            return True
        self._absent(key)
        return False

    def __missing__(self, key: Any) -> Any:
        self._absent(key)  # a defaultdict's entry made on first use
        factory = getattr(self.original, "default_factory", None)
        if factory is None:
            raise KeyError(key)
        self[key] = value = factory()  # a write, replayed
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        key = _known_key(self, key)
        if self.recorder.recording:
            self.written.add(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        key = _known_key(self, key)
        self.written.add(key)
        dict.__delitem__(self, key)

    def _keys_of_traced(self) -> dict[int, Any]:
        """Its keys that are the step's own tensors (parameters), by the id of the traced
        tensor standing for each: the body looks them up with those."""
        stand_in = getattr(self.recorder, "stand_in", {}) if self.recorder.recording else {}
        return {id(stand_in[id(k)]): k for k in dict.keys(self) if id(k) in stand_in}

    def _traced(self, keys: Any) -> Any:
        """``keys`` as the body sees them: a parameter as its traced tensor."""
        stand_in = getattr(self.recorder, "stand_in", {}) if self.recorder.recording else {}
        return [stand_in.get(id(k), k) if isinstance(k, Tensor) else k for k in keys]

    def _read_all(self) -> None:
        for key in list(dict.keys(self)):
            self._read(key)

    def _read_keys(self) -> None:
        if self.recorder.recording:
            self.recorder.guard(self.location.child("keys", None), tuple(self.original))

    # Iterated, the dict is no longer read by CPython's own fast path, unseen: dict(cfg),
    # {**cfg} and f(**cfg) then go through keys() and __getitem__.
    def __iter__(self) -> Any:
        return iter(self.keys())

    def keys(self) -> Any:
        self._read_keys()
        return dict.keys(self) if not self._keys_of_traced() else self._traced(dict.keys(self))

    def copy(self) -> dict:
        self._read_all()
        return dict(dict.items(self))

    def items(self) -> Any:
        self._read_all()
        if not self._keys_of_traced():
            return dict.items(self)
        return list(zip(self._traced(dict.keys(self)), dict.values(self), strict=True))

    def values(self) -> Any:
        self._read_all()
        return dict.values(self)


def _known_key(mapping: RecordingDict, key: Any) -> Any:
    """The key eager looks up: a parameter's for the traced tensor standing for it (a dict
    keyed by parameters, ``slow[p]`` of a Lookahead). A key formatted from a number the step
    computes is refused (improved-diffusion's ``logger.logkv_mean(f"{key}_q{quartile}",
    ...)``, ``quartile`` from a timestep's value): while traced it is a stand-in, so which
    entry the body reads or writes is not known, where eager's entry follows the value.
    Before 2026-11-29 the stand-in stayed the key, silently: an entry per call, never
    eager's; and a parameter's stand-in was a ``KeyError``."""
    if isinstance(key, str) and "\x00functacc" in key and mapping.recorder.recording:
        from ..errors import computed_key_error

        raise computed_key_error(key, f"the dict at {mapping.location.label}")
    return mapping._keys_of_traced().get(id(key), key) if isinstance(key, Tensor) else key


class RecordingGroup(RecordingDict):
    """An optimizer's param group while the body is traced: a numeric hyperparameter reads
    as the value fed to the graph on every call (``params`` is not recorded)."""

    def __init__(self, original: dict, location: Location, recorder: Any, index: tuple[int, int]):
        super().__init__(original, location, recorder)
        self.index = index  # (the optimizer's, the group's)
        self.fed: dict[str, Any] = {}  # key -> the symbolic value (lazily made)

    def _read(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        if key == "params" or key in self.written or not self.recorder.recording:
            return value
        self.recorder._read_first.add((id(self), key))
        if key == "lr" and (after := _rate_after_scheduler(self)) is not None:
            return after
        fed = self._fed_entry(key, value)
        if fed is not None:
            return fed
        fed = self._fed_hyperparameter(key)
        if fed is not None:
            return fed
        self.recorder.guard(self.location.child("item", key), value)
        return value

    def _fed_entry(self, key: str, value: Any) -> Any:
        """The fed number(s) standing for this entry (an optimizer traced whole), or
        ``None``."""
        symbolic = self.recorder.symbolic_inputs
        location = self.location.child("item", key)
        fed = symbolic.get(location)
        if fed is not None:
            return fed
        if type(value) in (tuple, list) and value:
            parts = [symbolic.get(location.child("item", j)) for j in range(len(value))]
            if all(p is not None for p in parts):
                return type(value)(parts)
        return None

    def _fed_hyperparameter(self, key: str) -> Any:
        """The value of this entry fed to the graph (the ``.item()`` of its input, or the
        input itself for a tensor entry), or ``None`` where it stays a guarded constant."""
        if key in self.fed:
            return self.fed[key]
        location = self.location.child("item", key)
        entry = self.recorder.hyper.get(self.index, {}).get(key)
        if entry is None or location in self.recorder.pinned:
            return None
        kind, inputs = entry
        if kind == "tensor":
            value: Any = inputs
        else:
            values = []
            for t in inputs if kind == "numbers" else (inputs,):
                v = t.item()
                self.recorder.symbols[v.node.expr] = location
                values.append(v)
            value = tuple(values) if kind == "numbers" else values[0]
        self.fed[key] = value
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if key == "params":
            dict.__setitem__(self, key, value)
        else:
            super().__setitem__(key, value)

    def _read_all(self) -> None:
        for key in list(dict.keys(self)):
            if key != "params":
                self._read(key)


def _rate_after_scheduler(group: RecordingGroup) -> Any:
    """``group["lr"]`` read after a scheduler of its optimizer stepped in the body: the rate
    that step sets, known once the step is replayed after the graph, as its
    ``get_last_lr()`` (eager reads the new rate; the trace's value is the old one)."""
    from .python_schedulers import LastLR, sets_lr

    for event in reversed(group.recorder.schedulers):
        if not sets_lr(event.scheduler):  # a timm scheduler of the weight decay
            continue
        groups = getattr(getattr(event.scheduler, "optimizer", None), "param_groups", ())
        index = next((i for i, g in enumerate(groups) if g is group), None)
        if index is not None:
            count = sum(e.scheduler is event.scheduler for e in group.recorder.schedulers)
            return LastLR(event.scheduler, count, index)
    return None


def groups_root(linked: Any) -> Root:
    """The root of an optimizer's ``param_groups`` locations: one per optimizer, so that a
    guard or a fed value found by one trace is the same location in the next."""
    root = getattr(linked, "_groups_root", None)
    if root is None:
        opt = linked.optimizer
        root = Root(f"{linked.label}.param_groups", lambda: opt.param_groups, None)
        root.external = True
        linked._groups_root = root
    return root


def shared(
    root_values: list[tuple[Root, Any]], objects: dict[int, tuple[Location, Any]]
) -> dict[int, list[Location]]:
    """For each container found (``objects``: by id, at its first location), the other
    roots and object attributes that hold it: a feature hook's closure cell holding the
    dict the body reads, a trainer's ``self.master_params = self.model_params``. Its
    recording copy is installed at each, so that what the body writes through one name it
    reads through the other, as in eager. (Not an item of another container: that one is
    a recording copy made later, from the original's items.)"""
    places: dict[int, list[Location]] = {}
    held = [(Location(root), value) for root, value in root_values]
    for location, obj in objects.values():
        if not _is_container(obj):  # an object's attributes (a container's items: above)
            held += [(location.child("attr", k), v) for k, v in fields_of(obj).items()]
    for location, value in held:
        first = objects.get(id(value), (None,))[0]
        if first is not None and location != first and _is_container(value):
            places.setdefault(id(value), []).append(location)
    return places


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, deque))
