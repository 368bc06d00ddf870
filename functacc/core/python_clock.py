"""The clock read in a traced step: a number fed to the graph, read before each call.

Eager code reads the clock in its step to log a rate or an iteration time (CleanRL's
``int(global_step / (time.time() - start_time))`` for its SPS line, minGPT's
``tnow = time.time(); self.iter_dt = tnow - self.iter_time``). A trace runs that Python
once, so the time it read would be every call's. Instead each read of ``time.time()``,
``perf_counter()``, ``monotonic()`` (and their ``_ns`` forms) in the step's own code is a
:class:`ClockRead`: a number fed to the graph, read on the host when the call starts, so
what the step computes and logs with it is computed with this call's time. The time is the
call's start, not the moment the body reached the read: within one step of eager's. Each
clock is read once per call (:func:`new_call`): the signature's check of the branches taken
on it, the trace and the run see one value, so a program is kept under the branches its
trace took (a key read a moment later could name another's: a progress bar's ``Tot: 1s``).

Example:
    >>> read = ClockRead(0, "perf_counter")
    >>> read.label, isinstance(read.get(), float)
    ("time.perf_counter() (the step's read 0)", True)
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["NUMERIC_CLOCKS", "ClockRead", "fed_clock", "new_call"]

NUMERIC_CLOCKS = frozenset(
    ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns")
)
_CLOCKS = {name: getattr(time, name) for name in NUMERIC_CLOCKS}  # not a watch's stand-in
_NOW: dict[str, Any] = {}  # this call's reading of each clock


def new_call() -> None:
    """A jitted call starts: the clocks it reads are read afresh, once."""
    _NOW.clear()


class ClockRead:
    """The ``index``-th clock read of a step, by ``time.<name>()``: a fed location."""

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name
        self.label = f"time.{name}() (the step's read {index})"

    def get(self) -> Any:
        value = _NOW.get(self.name)
        if value is None:
            value = _NOW[self.name] = _CLOCKS[self.name]()
        return value

    def set(self, value: Any) -> None:
        """Nothing to install: the traced step reads it through the clock."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClockRead) and (self.index, self.name) == (
            other.index,
            other.name,
        )

    def __hash__(self) -> int:
        return hash(("clock", self.index, self.name))

    def __repr__(self) -> str:
        return f"ClockRead({self.label})"


def fed_clock(name: str, index: int) -> Any:
    """While a body is traced: the symbol of its ``index``-th clock read, or None where no
    body is traced (a plain function). The first trace that reads it asks to feed it (a
    :class:`~.python_trace.Retry`: the next trace gets the symbol)."""
    from .python_recording import ACTIVE
    from .python_trace import Retry

    if name not in NUMERIC_CLOCKS or not ACTIVE:
        return None
    read = ClockRead(index, name)
    value = ACTIVE[-1].symbolic_inputs.get(read)
    if value is None:
        raise Retry([read])
    return value
