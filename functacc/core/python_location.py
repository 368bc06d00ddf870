"""A place in a step body's Python state: a :class:`Root` (a closure cell, a global, a
parameter's default, ``self``) and a path of attribute and item steps from it.

:mod:`.python_reach` finds the roots a body's code can read; a :class:`Location` is read
afresh on every call (a guarded number, a fed tensor) and written where the body wrote
(a replayed effect). A class's attributes (``Logger.CURRENT``) are places too.

Example:
    >>> config = {"scale": 0.5}
    >>> root = Root("global config", lambda: config, None)
    >>> Location(root, (("item", "scale"),)).get()
    0.5
    >>> Location(root, (("item", "scale"),)).label
    "global config['scale']"
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

__all__ = ["MISSING", "Location", "ModuleRoot", "Root", "fields_of", "slot_names"]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
"""What a location holds when its attribute, item or variable does not exist."""


class Root:
    """Where a path starts: a closure cell, a module's global, ``self``."""

    def __init__(
        self,
        label: str,
        get: Callable[[], Any],
        set_: Callable[[Any], None] | None,
        loaded: bool = True,
    ):
        self.label = label
        self._get, self._set = get, set_
        self.loaded = loaded  # the code reads it (not only assigns it)
        # Its values are given to the traced body by their owner (an optimizer's
        # param_groups and state): a fed value is not installed at the location.
        self.external = False

    def get(self) -> Any:
        return self._get()

    def set(self, value: Any) -> None:
        if self._set is None:
            raise TypeError(f"{self.label} cannot be reassigned")
        self._set(value)

    def __repr__(self) -> str:
        return f"Root({self.label})"


class ModuleRoot(Root):
    """A module whose Python attributes the body writes (a torchmetrics ``Metric``'s
    ``_update_count``): followed as a plain object is, its tensors left to the capture."""

    def __init__(self, label: str, module: Any):
        super().__init__(f"module {label}", lambda: module, None, loaded=False)


_LABELS = {
    "attr": ".{}",
    "item": "[{!r}]",
    "len": ".__len__()",
    "has": ".__contains__({!r})",
    "keys": ".keys()",
}


class Location:
    """A root and a path of ``("attr", name)`` / ``("item", key)`` steps from it."""

    __slots__ = ("label", "root", "steps")

    def __init__(self, root: Root, steps: tuple[tuple[str, Any], ...] = ()):
        self.root = root
        self.steps = steps
        self.label = root.label + "".join(_LABELS[kind].format(k) for kind, k in steps)

    def child(self, kind: str, key: Any) -> Location:
        return Location(self.root, (*self.steps, (kind, key)))

    def _parent(self) -> Any:
        value = self.root.get()
        for kind, key in self.steps[:-1]:
            value = _step(value, kind, key)
        return value

    def get(self) -> Any:
        value = self.root.get()
        for kind, key in self.steps:
            if value is MISSING:
                return MISSING
            value = _step(value, kind, key)
        return value

    def set(self, value: Any) -> None:
        if not self.steps:
            self.root.set(value)
            return
        parent = self._parent()
        kind, key = self.steps[-1]
        if kind == "attr":  # a class's, a thread-local's (scikit-learn's config) their own way
            plain = not isinstance(parent, (type, threading.local))
            (object.__setattr__ if plain else setattr)(parent, key, value)
        elif isinstance(parent, tuple):  # rebuilt, with this item replaced
            items = [value if i == key else v for i, v in enumerate(parent)]
            rebuilt = type(parent)(*items) if hasattr(parent, "_fields") else type(parent)(items)
            Location(self.root, self.steps[:-1]).set(rebuilt)
        else:
            parent[key] = value

    def delete(self) -> None:
        if not self.steps:
            self.root.set(MISSING)
            return
        parent = self._parent()
        kind, key = self.steps[-1]
        (fields_of(parent) if kind == "attr" else parent).pop(key, None)

    def __repr__(self) -> str:
        return f"Location({self.label})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and self.root is other.root and self.steps == other.steps

    def __hash__(self) -> int:
        return hash((id(self.root), self.steps))


def _step(value: Any, kind: str, key: Any) -> Any:
    if kind == "len":
        return len(value) if isinstance(value, (list, dict, collections.deque)) else MISSING
    if kind == "has":  # whether a dict has the key (a guard on a key the body found absent)
        return dict.__contains__(value, key) if isinstance(value, dict) else MISSING
    if kind == "keys":  # a dict's keys, in order (a guard for a dict whose reads are unseen)
        return tuple(dict.keys(value)) if isinstance(value, dict) else MISSING
    if kind == "attr":
        fields = getattr(value, "__dict__", None)
        if fields is None and not isinstance(value, type) and slot_names(type(value)):
            fields = _SlotFields(value)  # a class with __slots__
        return fields.get(key, MISSING) if fields is not None else MISSING
    try:
        return value[key]
    except (KeyError, IndexError, TypeError):
        return MISSING


def fields_of(obj: Any) -> MutableMapping[str, Any]:
    """``obj``'s attributes as a mapping to read and write: its ``__dict__``, for a class a
    view that writes through ``setattr`` (a class's ``__dict__`` is read-only), for an
    object of a class with ``__slots__`` and no ``__dict__`` a view of its slots."""
    if isinstance(obj, type):
        return _ClassFields(obj)
    return vars(obj) if hasattr(obj, "__dict__") else _SlotFields(obj)


def slot_names(cls: type) -> list[str]:
    """The slots a class's instances hold values in (its and its bases' ``__slots__``)."""
    names = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in dict.fromkeys(names) if n not in ("__dict__", "__weakref__")]


class _SlotFields(MutableMapping):
    def __init__(self, obj: Any):
        self.obj = obj

    def __getitem__(self, key: str) -> Any:
        if key not in slot_names(type(self.obj)):
            raise KeyError(key)
        try:
            return object.__getattribute__(self.obj, key)
        except AttributeError:  # a slot not set
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        object.__setattr__(self.obj, key, value)  # not a write of the body's (recording)

    def __delitem__(self, key: str) -> None:
        self[key]  # a KeyError where not set, as a dict's
        object.__delattr__(self.obj, key)

    def __iter__(self) -> Iterator[str]:
        return iter([k for k in slot_names(type(self.obj)) if k in self])

    def __len__(self) -> int:
        return len(list(iter(self)))


class _ClassFields(MutableMapping):
    def __init__(self, cls: type):
        self.cls = cls

    def __getitem__(self, key: str) -> Any:
        return vars(self.cls)[key]

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.cls, key, value)

    def __delitem__(self, key: str) -> None:
        if key not in vars(self.cls):
            raise KeyError(key)  # as a dict's (MutableMapping.pop's default needs it)
        delattr(self.cls, key)

    def __iter__(self) -> Iterator[str]:
        return iter(list(vars(self.cls)))

    def __len__(self) -> int:
        return len(vars(self.cls))
