"""A file the step body opens to write (a log line a step), written after each call.

karpathy/build-nanogpt appends ``f"{step} train {loss_accum.item():.6f}\\n"`` to its log
file in the step. Traced, the body's Python runs once: the file got one line, with the
trace's tokens in place of the numbers. While the body is traced, ``open()`` for writing
or appending, called from the user's code, gives a :class:`NotedFile`: each ``write``
(and ``print(..., file=f)``) is noted as an effect (:mod:`.python_effects`) that opens the
file as the body did and writes the call's text after each call (``"w"`` truncating at
the first write, as eager's ``open`` does on every call). A file opened before the step
and held in its Python state (a global ``log = open("train.log", "a")``) is an
:class:`OpenFile` while the body is traced: its writes are made on it after each call, with
the call's text. Reading files is not changed.

Example:
    >>> noted = []
    >>> f = NotedFile("log.txt", "w", (), {}, lambda *call: noted.append(call))
    >>> f.write("a"), f.write("b")
    (1, 1)
    >>> [args[1] for _, args, _, _ in noted]  # the second write appends
    ['w', 'a']
"""

from __future__ import annotations

import builtins
import io
from collections.abc import Callable, Iterable
from typing import Any

from .python_effects import Effect

__all__ = ["NotedFile", "OpenFile", "noting_files", "noting_open", "write_to"]

_WRITES = "wax+"  # a mode with one of these writes


class NotedFile:
    """A file opened for writing by the body while it is traced: its writes are noted."""

    def __init__(self, file: Any, mode: str, args: tuple, kwargs: dict, note: Callable) -> None:
        self.file, self.mode, self.args, self.kwargs, self._note = file, mode, args, kwargs, note

    def write(self, data: Any) -> int:
        self._note(write_to, [self.file, self.mode, data, self.args, self.kwargs], {}, "write()")
        self.mode = self.mode.replace("w", "a").replace("x", "a")  # the next write appends
        return len(data)

    def writelines(self, lines: Iterable[Any]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NotedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def write_to(file: Any, mode: str, data: Any, args: tuple, kwargs: dict) -> None:
    """One noted write, run after a call."""
    with builtins.open(file, mode, *args, **kwargs) as f:
        f.write(data)


def noting_open(real_open: Callable, note: Callable, from_user: Callable[[int], bool]) -> Any:
    """``open`` while the body is traced: for writing, from the user's code, a
    :class:`NotedFile`; else the real file."""

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not any(c in mode for c in _WRITES) or not from_user(1):
            return real_open(file, mode, *args, **kwargs)
        return NotedFile(file, mode, args, kwargs, note)

    return open_


class OpenFile:
    """A file open for writing that the step's Python state holds, while the body is
    traced: each write is made on the file after each call, with that call's text."""

    def __init__(self, file: Any, recorder: Any) -> None:
        self._file, self._recorder = file, recorder

    def write(self, data: Any) -> int:
        self._note(self._file.write, data)
        return len(data)

    def writelines(self, lines: Iterable[Any]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._note(self._file.flush)

    def _note(self, method: Callable, *args: Any) -> None:
        effect = Effect.call(method, args, {}, self._recorder.template, where="a write to a file")
        self._recorder.effects.append(effect)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def noting_files(held: list[tuple[Any, Any]], recorder: Any, originals: dict) -> Callable:
    """Put an :class:`OpenFile` where the body's state holds a file open for writing
    (``held``: location and file pairs); ``originals`` learns what each stands for.
    Returns the undo."""
    installed = []
    for location, file in held:
        if isinstance(file, io.IOBase) and not file.closed and file.writable():
            noted = OpenFile(file, recorder)
            originals[id(noted)] = file
            location.set(noted)
            installed.append((location, file))

    def undo() -> None:
        for location, file in reversed(installed):
            location.set(file)

    return undo
