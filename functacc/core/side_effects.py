"""Python state a step body changes outside its modules: an error, not a silent one-off.

A jitted body's Python runs once, when it is traced; the compiled graph replays only its
tensor operations. A body that appends its loss to a list, counts its calls in a
``nonlocal`` or ``global`` variable, or stores a tensor in a dictionary would do that once
(and store a tracing placeholder, not a value), where eager does it on every call.
:class:`OuterStateWatch` compares what the body's closure and the globals it names hold
before and after the trace, refuses a change, and puts the old state back. As for module
attributes, filling in something that was ``None`` (a cache built once) is allowed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..errors import argument_error

__all__ = ["OuterStateWatch"]

_CONTAINERS = (list, dict, set)


class OuterStateWatch:
    """Watches the variables ``fn`` reads from its closure and its module's globals.

    Example:
        >>> history = []
        >>> def body(x):
        ...     history.append(x)
        >>> watch = OuterStateWatch(body)
        >>> with watch:
        ...     body(1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: the step body changed Python state outside its modules: ...
        >>> history
        []
    """

    def __init__(self, fn: Callable[..., Any]):
        self.scopes = _scopes(fn)

    def __enter__(self) -> OuterStateWatch:
        self.before = {
            (i, name): (value, _copy(value))
            for i, (_, scope) in enumerate(self.scopes)
            for name, value in scope.items()
        }
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        changed = []
        for (i, name), (old, contents) in self.before.items():
            kind_name, scope = self.scopes[i]
            new = scope.get(name)
            if new is not old:
                if old is None and not isinstance(new, Tensor):
                    continue  # filled in once, in eager too
                changed.append(f"{name!r} ({kind_name} reassigned)")
                scope.set(name, old)
            elif contents is not None and not _same_contents(old, contents):
                changed.append(f"{name!r} ({type(old).__name__} changed in place)")
                _restore(old, contents)
        if changed and kind is None:
            raise argument_error(
                f"the step body changed Python state outside its modules: {changed}. Its "
                "Python runs once, when functacc.jit traces it, so this would happen once "
                "(holding a tracing placeholder, not a value) where eager does it on every "
                "call. Return the values instead (losses, counters) and keep them in the "
                "loop: history.append(step(x, y))."
            )


class _Scope:
    """Read and write a variable of a closure or a module's globals by name."""

    def __init__(self, get: Callable[[], dict[str, Any]], set_: Callable[[str, Any], None]):
        self._get, self._set = get, set_

    def items(self) -> list[tuple[str, Any]]:
        return list(self._get().items())

    def get(self, name: str) -> Any:
        return self._get().get(name)

    def set(self, name: str, value: Any) -> None:
        self._set(name, value)


def _scopes(fn: Callable[..., Any]) -> list[tuple[str, _Scope]]:
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object or a partial: nothing to watch by name
        return []
    scopes = []
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
    if cells:

        def closure() -> dict[str, Any]:
            out = {}
            for name, cell in cells.items():
                try:
                    out[name] = cell.cell_contents
                except ValueError:  # not yet assigned
                    out[name] = None
            return out

        def set_cell(name: str, value: Any) -> None:
            cells[name].cell_contents = value

        scopes.append(("closure variable", _Scope(closure, set_cell)))
    module_globals = fn.__globals__
    names = [n for n in code.co_names if n in module_globals]
    watched = [n for n in names if _watchable(module_globals[n])]
    if watched:
        scopes.append(
            (
                "global",
                _Scope(
                    lambda: {n: module_globals.get(n) for n in watched},
                    module_globals.__setitem__,
                ),
            )
        )
    return scopes


def _watchable(value: Any) -> bool:
    return not (inspect.ismodule(value) or inspect.isclass(value) or callable(value))


def _copy(value: Any) -> Any:
    if type(value) in _CONTAINERS:
        return type(value)(value)
    return None


def _same_contents(value: Any, contents: Any) -> bool:
    if len(value) != len(contents):
        return False
    if isinstance(value, dict):
        return all(k in contents and value[k] is contents[k] for k in value)
    if isinstance(value, list):
        return all(a is b for a, b in zip(value, contents, strict=True))
    return value == contents


def _restore(value: Any, contents: Any) -> None:
    value.clear()
    if isinstance(value, dict):
        value.update(contents)
    elif isinstance(value, list):
        value.extend(contents)
    else:
        value.update(contents)
