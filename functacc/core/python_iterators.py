"""Batches drawn inside the step: ``next(it)`` on an iterator made before the call.

A loop that jits the body of ``for step in range(n):`` often draws its batch there:
``x, y = next(train_iter)`` (a generator, ``iter(loader)``, ``itertools.cycle(loader)``), or
lucidrains' ``loss = model(next(train_loader))``. ``functacc.jit`` runs the body's Python once,
while tracing: the batch drawn then would be a constant of the graph, and every later call
would train on it again where eager draws a new one, silently (a batch made from NumPy by
``torch.from_numpy`` is not a tensor of the program the trace can refuse). So, while a step
is traced, ``next()`` of an iterator the body reaches from outside (a closure variable, a
global, an attribute of ``self`` or of an object reached from them, an argument) and any
iteration of a ``DataLoader`` are errors that say to draw the batch before the call and pass
it in; so is such an iterator that the trace advanced by other means (``for batch in gen:``),
where that can be told: a generator, a list's or a range's iterator.

Example:
    >>> import itertools
    >>> from functacc.core.python_reach import Root
    >>> it = itertools.count()
    >>> found = outside_iterators([Root("closure variable 'it'", lambda: it, None)], [])
    >>> list(found.values())[0][0]
    ("closure variable 'it'", 'it')
"""

from __future__ import annotations

import builtins
import contextlib
import operator
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import dataloader

from ..errors import TraceError
from .python_location import Root
from .python_reach import entries, plain_objects

__all__ = ["no_batches_drawn", "outside_iterators"]


def outside_iterators(
    roots: Sequence[Root], leaves: Sequence[Any], objects: dict | None = None
) -> dict[int, tuple[Any, Any]]:
    """The iterators the body reaches from outside, by ``id``: what names it in the error
    (the label, and the code for the advice) and the object. ``objects``: the plain objects
    the roots reach, as found before a trace put its recording copies in place (a dict's
    copy is not walked: ``state["it"]`` was missed before 2026-11-28, its next() made once)."""
    found: dict[int, tuple[Any, Any]] = {}

    def note(value: Any, label: str, code: str) -> None:
        if _is_iterator(value) and id(value) not in found:
            found[id(value)] = ((label, code), value)

    for root in roots:
        note(root.get(), root.label, _code(root))
    reached = plain_objects(list(roots)) if objects is None else objects
    for location, obj in reached.values():
        base = _code(location.root) + location.label[len(location.root.label) :]
        for kind, key, value in entries(obj):
            key = f"[{key!r}]" if kind == "item" else f".{key}"
            note(value, location.label + key, base + key)
    for value in leaves:
        note(value, "an argument of the call", "it")
    return found


def _code(root: Root) -> str:
    """The name the body's code reads ``root`` by: ``closure variable 'it'`` is ``it``."""
    if root.label.startswith("closure variable "):
        return root.label[len("closure variable ") :].strip("'")
    return root.label.rsplit(".", 1)[-1] if root.label.startswith("global ") else root.label


def _is_iterator(value: Any) -> bool:
    # Files are iterators too (a log file the step writes to), but only next() of one is
    # refused, so holding one is fine.
    return hasattr(type(value), "__next__") and not isinstance(value, torch.Tensor)


@contextlib.contextmanager
def no_batches_drawn(iterators: dict[int, tuple[Any, Any]]) -> Iterator[None]:
    """While inside (the body traced): ``next()`` of one of ``iterators``, or of a
    ``DataLoader``'s iterator, is a :class:`~functacc.errors.TraceError`; after it, so is one
    of them seen to have advanced."""
    original_next = builtins.next
    loader_next = dataloader._BaseDataLoaderIter.__next__
    positions = {key: _position(it) for key, (_, it) in iterators.items()}

    # Only the tracing thread's draws: a DeviceLoader's prefetch thread draws meanwhile.
    tracing = threading.get_ident()

    def checked_next(iterator: Any, *default: Any) -> Any:
        known = iterators.get(id(iterator))
        if known is not None and known[1] is iterator and threading.get_ident() == tracing:
            raise _drawn_error(known[0], iterator)
        return original_next(iterator, *default)

    def refused_loader_next(self: Any) -> Any:
        if threading.get_ident() != tracing:
            return loader_next(self)
        raise _drawn_error(("a DataLoader", "it"), self)

    builtins.next = checked_next
    dataloader._BaseDataLoaderIter.__next__ = refused_loader_next
    try:
        yield
    finally:
        builtins.next = original_next
        dataloader._BaseDataLoaderIter.__next__ = loader_next
    for key, before in positions.items():
        label, iterator = iterators[key]
        if before is not None and _position(iterator) != before:
            raise _drawn_error(label, iterator)


def _position(iterator: Any) -> Any:
    """Where ``iterator`` is, as far as can be told from outside (``None``: it cannot be).
    A generator: its frame's instruction and locals (a loop yields from one instruction),
    and where the iterator it delegates to is; a built-in iterator: its length hint."""
    if isinstance(iterator, types.GeneratorType):
        frame = iterator.gi_frame
        if frame is None:
            return ()
        inner = iterator.gi_yieldfrom
        locals_ = tuple(id(v) for v in frame.f_locals.values())
        return frame.f_lasti, locals_, _position(inner) if inner is not None else None
    try:
        hint = operator.length_hint(iterator, -1)
    except Exception:  # a __length_hint__ of its own that fails: not to be told
        return None
    return hint if hint >= 0 else None


def _drawn_error(label: tuple[str, str], iterator: Any) -> TraceError:
    what = type(iterator).__name__
    if isinstance(iterator, dataloader._BaseDataLoaderIter):
        return TraceError(
            f"the step iterates {label[0]} ({what}): functacc.jit runs the step's Python once, "
            "while tracing, so the batches it loads there would be constants of the graph, "
            "trained on again at every call, where eager loads new ones. Fix: iterate the "
            "loader outside the step and pass each batch to the call: "
            "`for x, y in loader: step(x, y)` (or `batch = next(it)` before `step(batch)`)."
        )
    return TraceError(
        f"the step draws from {label[0]} (a {what}) with next(): functacc.jit runs the step's "
        "Python once, while tracing, so the batch drawn there would be a constant of the "
        "graph, trained on again at every call, where eager draws a new one per call. Fix: "
        f"draw the batch before the call and pass it in: `batch = next({label[1]}); "
        "step(batch)`."
    )
