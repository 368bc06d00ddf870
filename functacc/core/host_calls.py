"""``functacc.host(fn)``: a function of the step that runs on the host, after each call.

A progress bar or a logger of the user's own, called in the step with the numbers it
computed, branches in Python on them: kuangliu/pytorch-cifar's ``progress_bar(batch_idx,
len(loader), msg)`` draws ``int(65 * current / total)`` bars and formats the clock with
``if days > 0: ...``. Traced, each branch is a guard on a number that changes every call:
one trace per call (a tenth of a second or more, with no compile), where eager draws the bar
in microseconds. Wrapped with :func:`host`, such a function is not traced: while the step
body is traced its call is noted, with its arguments as templates of the call's values
(numbers the graph computes, text formatted from them), and made after each call, in the
body's order with its other output (as ``print`` is: :mod:`.python_output`). It reads and
writes its own Python state (a global ``last_time``) on the host, as eager does.

What it returns is not known in the trace: the body gets a stand-in that refuses every use
(a ``TraceError`` naming the function), so a host function whose result the step uses is an
error, not a silent ``None``. Numbers and text it is given are the call's; an object given
(a list) is passed as it is after the call.

Example:
    >>> import functacc
    >>> shown = []
    >>> show = functacc.host(lambda step, loss: shown.append(f"{step}: {loss:.2f}"))
    >>> show(3, 0.25), shown  # called outside a traced step: runs at once
    (None, ['3: 0.25'])
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import TraceError
from .python_effects import Effect
from .python_recording import ACTIVE

__all__ = ["host", "host_result_used", "result_unused"]

F = TypeVar("F", bound=Callable[..., Any])


def host(fn: F) -> F:
    """``fn``, run on the host after each call of a jitted step that calls it, with that
    call's values, instead of being traced (a progress bar, a logger of your own).

    Args:
        fn: a function whose result the step does not use.

    Returns:
        The wrapped function; called outside a traced step, it runs at once.

    Example:
        >>> import functacc
        >>> @functacc.host
        ... def progress(step, loss):
        ...     print(f"step {step}: {loss:.4f}")
        >>> progress(1, 0.5)
        step 1: 0.5000
    """
    if not callable(fn):
        raise TypeError(f"functacc.host expects a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not ACTIVE:
            return fn(*args, **kwargs)
        recorder, name = ACTIVE[-1], getattr(fn, "__qualname__", "a host function")
        where = f"the arguments of {name}()"
        recorder.effects.append(Effect.call(fn, args, kwargs, recorder.template, where=where))
        return _Unknown(name)

    # Not the user's code to the walk that finds what a body reads (python_reach): its
    # globals (ACTIVE) are functacc's, and fn's run on the host.
    call.__module__ = __name__
    return call  # type: ignore[return-value]


class _Unknown:
    """What a host function gives the traced body: its result exists only after the call,
    so any use of it is an error (a discarded result, the common case, is fine)."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        name = object.__getattribute__(self, "_name")
        raise TraceError(
            f"the step uses the result of {name}(), a functacc.host function: it runs after "
            "each call, so its result does not exist inside the step. Fix: call it where its "
            "result is used, outside the step, or do not wrap it with functacc.host."
        )

    def __repr__(self) -> str:
        return f"<result of {object.__getattribute__(self, '_name')}(), known after the call>"


def result_unused(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn``'s code calls ``name`` only as a statement of its own (a progress bar:
    ``progress_bar(i, n, msg)``), so that :func:`host` can take it; not where the result is
    used (``lr = get_lr(it)``). True where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(fn, "__func__", fn))))
    except (OSError, TypeError, SyntaxError):
        return True
    statements = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    for node in ast.walk(tree):
        callee = getattr(node, "func", None)
        called = getattr(callee, "id", None) or getattr(callee, "attr", None)
        if isinstance(node, ast.Call) and called == name and id(node) not in statements:
            return False
    return True


def host_result_used(exc: BaseException) -> TraceError | None:
    """The error for ``exc`` if torch's C++ was handed a host function's result (an optimizer
    given ``lr=get_lr(it)`` of a wrapped ``get_lr``: "must be Number, not _Unknown"), which
    asks it nothing a stand-in could refuse; None otherwise."""
    if not isinstance(exc, TypeError) or "_Unknown" not in str(exc):
        return None
    tb = exc.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, _Unknown):
                try:
                    value._refuse()
                except TraceError as error:
                    return error
        tb = tb.tb_next
    return None


for _use in (
    "__bool__", "__getattr__", "__setattr__", "__iter__", "__len__", "__getitem__",
    "__contains__", "__call__", "__str__", "__format__", "__int__", "__float__", "__index__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__lt__", "__le__", "__gt__", "__ge__", "__neg__",
):  # fmt: skip
    setattr(_Unknown, _use, _Unknown._refuse)
