"""A NumPy schedule indexed by the step counter, looked up in the graph.

DINO, MAE, DeiT and their kin precompute their schedules as NumPy arrays and index them
with the global iteration in the step: ``param_group["lr"] = lr_schedule[it]``. NumPy asks
the traced counter for a real integer, which fixes it: one trace per step (and a
:class:`~functacc.RetraceError` after ``max_traces``). While the body is traced, a 1-D
``float64`` or ``int64`` array it reaches (an argument, a closure variable, a global) is a
view of class :class:`LookupTable`: indexed by a traced integer, it gives the entry as the
graph computes it (the table a constant of the graph, its entry a traced number); anything
else is NumPy's own. The array's contents are part of the step's signature, so writing into
it between calls traces again.

A numeric array the step writes into (a loss history kept in place, ``hist[epoch] =
loss.item()``, in a variable, an attribute ``self.hist`` or a dict entry) has the write made
after each call, with the call's value and position (an effect of the step, replayed as
``print``'s are; a write of plain values is made in the trace too); the array is then keyed
by identity, not contents (its contents change at every call). A step that reads the array
and then writes it (``counts[k] += 1``: the trace's values, written at every call), or reads
what it wrote with a traced value, is refused. Any other change the trace makes to a numeric
array the body reaches (``arr.fill``, ``arr.sort``, ``np.copyto``, a write through a slice
or a view, into an array a list holds) would be made once, when traced: :class:`ArrayWatch`
compares every such array after the trace, refuses the step that changed one, and puts its
contents back.

Example:
    >>> import numpy as np
    >>> table = as_lookup(np.linspace(0.0, 1.0, 5))
    >>> type(table).__name__, float(table[2])
    ('LookupTable', 0.5)
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

__all__ = [
    "ArrayWatch",
    "LookupTable",
    "as_lookup",
    "install_tables",
    "is_array",
    "table_key",
    "table_repr",
]

_KINDS = (np.dtype(np.float64), np.dtype(np.int64))


class LookupTable(np.ndarray):
    """A NumPy array whose entry at a traced integer is computed in the graph (a 1-D table)
    and, where the step reaches it through a variable, whose writes of traced values are
    made after each call (:meth:`__setitem__`)."""

    _recorder: Any = None  # the trace's Recorder, for a table a variable holds
    _place: Any = None  # (its Location, the array it views)
    _state: str = ""  # "read", "written" (by the trace running)

    def __getitem__(self, index: Any) -> Any:
        self._reading("indexes it")
        if isinstance(index, torch.SymInt) and self.ndim == 1 and self.dtype in _KINDS:
            return torch.as_tensor(self.view(np.ndarray)).select(0, index).item()
        return super().__getitem__(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        if self._recorder is None:
            return super().__setitem__(index, value)
        location, array = self._place
        traced = _traced((index, value))
        if self._state == "read":  # counts[k] += 1: the trace's values, written every call
            raise _read_and_written(location.label, "reads it too (counts[k] += 1)")
        if traced and not all(isinstance(i, (int, torch.SymInt)) for i in _flat(index)):
            raise _read_and_written(location.label, f"at {index!r}: index it with integers")
        if not traced:  # a plain write, made now (the step may read it) and after each call
            super().__setitem__(index, value)
            self._recorder.arrays.expected[id(array)][index] = value
        from .python_effects import Effect

        recorder = self._recorder
        self._state = "written" if traced else self._state or "plain"
        recorder.guards.pop(location, None)  # keyed by identity now: its contents change
        recorder.loose[location] = array
        where = f"a write into NumPy array {location.label}"
        recorder.effects.append(
            Effect.call(_write, (array, index, value), {}, recorder.template, where=where)
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        written = [x for x in kwargs.get("out", ()) if getattr(x, "_recorder", None) is not None]
        if written:  # counts += 1, np.add(hist, x, out=hist): read, then written
            raise _read_and_written(written[0]._place[0].label, "updates it in place (+=, out=)")
        self._reading(f"computes with it (np.{ufunc.__name__})")
        plain = [x.view(np.ndarray) if isinstance(x, LookupTable) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(
                x.view(np.ndarray) if isinstance(x, LookupTable) else x for x in kwargs["out"]
            )
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        self._reading(f"computes with it (np.{func.__name__})")
        return super().__array_function__(func, types, args, kwargs)

    def _reading(self, how: str) -> None:
        if self._recorder is None:
            return
        if self._state == "written":  # a traced value: its write is made after the call
            raise _read_and_written(self._place[0].label, f"{how} after writing it")
        self._state = self._state or "read"


def as_lookup(value: Any) -> Any:
    """``value`` as a :class:`LookupTable` view where it is a 1-D table of numbers (where a
    variable holds it, :func:`install_tables`: any array of numbers)."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype in _KINDS:
        return value.view(LookupTable)
    return value


def _write(array: np.ndarray, index: Any, value: Any) -> None:
    """A write the step made into ``array``, made after the call with its values."""
    array[index] = value


def _flat(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _traced(value: Any) -> bool:
    from .python_numpy import TracedArray
    from .python_reach import holds_traced

    items = value if isinstance(value, (tuple, list)) else (value,)
    return holds_traced(value) or any(isinstance(v, TracedArray) for v in items)


def _read_and_written(label: str, what: str) -> Exception:
    from ..errors import TraceError

    return TraceError(
        f"the step writes into NumPy array {label} and {what}. functacc makes the step's "
        "writes into such an array after each call, with the call's values (hist[epoch] = "
        "loss.item()); what the step reads of it in the trace would be the trace's values, "
        "the same at every call. Fix: keep a count in a Python number or a tensor the step "
        "updates, values in a list (append), or write into the array after the call "
        "(hist[epoch] = step(...))."
    )


def is_array(value: Any) -> bool:
    """A NumPy array: guarded by its contents where the body reads it (a trace bakes what
    it converts to a tensor into the graph)."""
    return type(value) is np.ndarray or type(value) is LookupTable


class ArrayWatch:
    """The contents of the numeric NumPy arrays a trace reaches, before it and as its
    recorded writes leave them (``expected``), to compare after the trace and put back.

    Example:
        >>> from functacc.core.python_location import Location, Root
        >>> hist = np.zeros(3)
        >>> watch = ArrayWatch([(Location(Root("hist", lambda: hist, None)), hist)])
        >>> hist.fill(1.0)
        >>> watch.check()
        Traceback (most recent call last):
        functacc.errors.TraceError: the step changes NumPy array hist in place ...
        >>> watch.restore()
        >>> hist
        array([0., 0., 0.])
    """

    def __init__(self, arrays: list[tuple[Any, Any]], recorder: Any = None):  # held(..., ndarray)
        self.recorder, self.views = recorder, {}
        numeric = [
            (loc, a) for loc, a in arrays if type(a) is np.ndarray and a.dtype.kind in "iufcb"
        ]
        self.arrays = {id(a): (loc, a, a.copy()) for loc, a in reversed(numeric)}
        self.expected = {i: before.copy() for i, (_, _, before) in self.arrays.items()}

    def view(self, value: Any) -> Any:
        """The :class:`LookupTable` view of a watched array through which the trace reads it
        (an attribute's, a dict entry's: ``self.hist[epoch] = loss.item()``), whose writes are
        made after each call; any other value itself."""
        entry = self.arrays.get(id(value)) if type(value) is np.ndarray else None
        if entry is None or self.recorder is None:
            return value
        table = self.views.get(id(value))
        if table is None:
            table = self.views[id(value)] = value.view(LookupTable)
            table._recorder, table._place = self.recorder, (entry[0], value)
            self.recorder._originals[id(table)] = value  # assigned elsewhere: no new value
        return table

    def check(self) -> None:
        """Raise the error for a step that changed an array other than by a recorded write."""
        for i, (location, now, _) in self.arrays.items():
            expected = self.expected[i]
            if now.shape != expected.shape or now.tobytes() != expected.tobytes():
                from ..errors import TraceError

                raise TraceError(
                    f"the step changes NumPy array {location.label} in place other than by "
                    "item assignment, arr[index] = value (arr.fill(), arr.sort(), np.copyto(), "
                    "np.random.shuffle(), a write through a slice or a view, or into an array "
                    "a list holds). functacc.jit runs the "
                    "step's Python once, when it traces: the change would be made that once. "
                    "Fix: keep the values in a tensor the step updates in place (fed to the "
                    "graph and written back at every call) or in a list, or change the array "
                    "after the call."
                )

    def restore(self) -> None:
        """Every array as before the trace (the step's writes are made after each call)."""
        for _, now, before in self.arrays.values():
            if now.shape == before.shape:
                np.copyto(now, before)


def install_tables(recorder: Any) -> None:
    """While a body is traced: its variables that hold arrays of numbers hold their
    :class:`LookupTable` views (the recorder's ``originals`` maps each back: no write of the
    variable), guarded by contents, as is any other NumPy array they hold
    (``torch.as_tensor(obs)`` of a closure's ``obs`` that the loop reassigns or fills
    between calls: a new trace, not the old values). Every numeric array it reaches is
    watched (:class:`ArrayWatch`, ``recorder.arrays``)."""
    from .python_location import Location
    from .python_reach import held

    arrays = held(recorder.variables, recorder.objects.values(), np.ndarray)
    recorder.arrays = ArrayWatch(arrays, recorder)
    recorder._undo.append(recorder.arrays.restore)
    for root, value in recorder.root_values:
        if root.loaded and is_array(value):
            table = recorder.arrays.view(value)
            if table is not value:
                root.set(table)
            recorder.guards.setdefault(Location(root), value)


def table_key(value: np.ndarray) -> tuple:
    """A NumPy array in a signature: by its contents (its ``repr`` elides the middle)."""
    return (np.ndarray, value.dtype.str, value.shape, value.tobytes())


def table_repr(key: Any) -> str | None:
    """A :func:`table_key` in words: shape, dtype and a checksum of the contents (``None``
    for another key)."""
    if not (isinstance(key, tuple) and key and key[0] is np.ndarray):
        return None
    _, dtype, shape, data = key
    return f"<NumPy array {shape} {np.dtype(dtype)} #{zlib.crc32(data):08x}>"
