"""A NumPy schedule indexed by the step counter, looked up in the graph.

DINO, MAE, DeiT and their kin precompute their schedules as NumPy arrays and index them
with the global iteration in the step: ``param_group["lr"] = lr_schedule[it]``. NumPy asks
the traced counter for a real integer, which fixes it: one trace per step (and a
:class:`~functacc.RetraceError` after ``max_traces``). While the body is traced, a 1-D
``float64`` or ``int64`` array it reaches (an argument, a closure variable, a global) is a
view of class :class:`LookupTable`: indexed by a traced integer, it gives the entry as the
graph computes it (the table a constant of the graph, its entry a traced number); anything
else is NumPy's own. The array's contents are part of the step's signature, so writing into
it traces again.

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

__all__ = ["LookupTable", "as_lookup", "install_tables", "is_array", "table_key", "table_repr"]

_KINDS = (np.dtype(np.float64), np.dtype(np.int64))


class LookupTable(np.ndarray):
    """A NumPy array whose entry at a traced integer is computed in the graph."""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, torch.SymInt):
            return torch.as_tensor(self.view(np.ndarray)).select(0, index).item()
        return super().__getitem__(index)


def as_lookup(value: Any) -> Any:
    """``value`` as a :class:`LookupTable` view where it is a 1-D table of numbers."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype in _KINDS:
        return value.view(LookupTable)
    return value


def is_array(value: Any) -> bool:
    """A NumPy array: guarded by its contents where the body reads it (a trace bakes what
    it converts to a tensor into the graph)."""
    return type(value) is np.ndarray or type(value) is LookupTable


def install_tables(root_values: list, originals: dict, guards: dict) -> None:
    """While a body is traced: its variables that hold tables hold their :class:`LookupTable`
    views (``originals`` maps each back: no write of the variable), guarded by contents, as
    is any other NumPy array they hold (``torch.as_tensor(obs)`` of a closure's ``obs``
    that the loop reassigns or fills between calls: a new trace, not the old values)."""
    from .python_location import Location

    for root, value in root_values:
        if not root.loaded or not is_array(value):
            continue
        if (table := as_lookup(value)) is not value:
            root.set(table)
            originals[id(table)] = value
        guards.setdefault(Location(root), value)


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
