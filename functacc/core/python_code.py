"""The code a step runs beyond its body's own: whose globals and cells are its state too.

The body's Python state is found in what its code names (:func:`~.python_reach.find_roots`:
its closure cells, the globals it and the user functions it calls by name read). A step
runs more of the user's code than that: the hooks registered on its modules, the methods of
its modules' own classes (a ``forward`` that counts its calls in a global dict), and the
callbacks it reaches in a dict, a list or an object (``hooks["on_step"]()``). Where that
code is in the user's own files (not an installed package's, followed where the body calls
it), its globals and cells are roots too: before 2026-11-28 a write there was made only when
the step was traced (``STATS["n"] += 1`` in a ``forward``: 2 after 4 calls, eager 4),
silently.

A module of the user's class the body reaches that is not in ``modules=`` and holds no
tensors (a criterion that counts its calls, a margin it keeps) is followed as a plain
object is (:func:`unlisted_modules`): before, its attributes' reads were baked into the
trace and its writes made only then.

Example:
    >>> import torch
    >>> reached_code([("m", torch.nn.Linear(2, 2))], [])  # torch's code: not the user's
    []
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from .held_objects import held_values
from .python_location import MISSING, Location, ModuleRoot, Root
from .python_output import is_user_code as _in_users_files
from .python_reach import _cell_value, _entry, _user_functions, held, is_user_code, plain_objects

__all__ = [
    "called_toward",
    "code_scopes",
    "function_attributes_kept",
    "module_classes",
    "module_hooks",
    "reached_code",
    "unlisted_modules",
]


def reached_code(modules: Iterable[tuple[str, nn.Module]], roots: list[Root]) -> list[Callable]:
    """The functions whose roots are the step's state beyond the body's: the ``modules``'
    hooks, their user classes' functions, and the user functions held where ``roots`` lead."""
    modules = [*modules, *((r.label, r.get()) for r in roots if isinstance(r, ModuleRoot))]
    found = module_hooks(modules) + _module_code(modules) + _held_functions(roots)
    return list({id(f): f for f in found}.values())


def code_scopes(fn: Callable[..., Any]) -> list[dict]:
    """The globals of the modules whose code ``fn`` runs: its own, and those of the user
    functions it reaches (as :func:`~.python_reach.find_roots` follows them)."""
    scopes = [f.__globals__ for f in _user_functions(*_entry(fn), set())]
    return list({id(s): s for s in scopes}.values())


def called_toward(fn: Callable[..., Any], name: str) -> str | None:
    """The name under which ``fn``'s code calls the user function that is, or calls on to,
    the function named ``name`` (a guard made in ``format_time``: ``progress_bar``)."""
    function = getattr(_entry(fn)[0], "__func__", None) or _entry(fn)[0]
    if not inspect.isfunction(function):
        return None
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))
    for called in function.__code__.co_names + function.__code__.co_freevars:
        value = function.__globals__.get(called, MISSING)
        value = _cell_value(cells[called]) if called in cells else value
        reached = _user_functions(value, None, set(), 1) if inspect.isfunction(value) else ()
        if any(f.__name__ == name for f in reached):
            return called
    return None


def module_hooks(modules: Iterable[tuple[str, nn.Module]]) -> list[Callable[..., Any]]:
    """The hooks registered on the step's modules (forward, pre-forward, backward): a
    feature hook writes its output into a dict of its closure (``feats[name] = out``) that
    the body reads, so their closures are the step's Python state too."""
    tables = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return [
        hook
        for _, module in modules
        for sub in module.modules()
        for table in tables
        for hook in getattr(sub, table, {}).values()
    ]


def module_classes(modules: Iterable[tuple[str, nn.Module]]) -> list[Root]:
    """The user's classes of the step's modules, each a root: their class attributes are
    step state that the modules' code reads and writes (``type(self).calls += 1``,
    ``Block.count += 1``), followed as a user class's named by the body is."""
    classes = {c for _, m in modules for sub in m.modules() for c in type(sub).__mro__}
    return [
        Root(f"class {c.__qualname__}", functools.partial(lambda c: c, c), None, loaded=False)
        for c in sorted(classes, key=lambda c: c.__qualname__)
        if c is not nn.Module and _users_own(c)
    ]


def _module_code(modules: list[tuple[str, nn.Module]]) -> list[Callable[..., Any]]:
    """The functions of the user's classes among the modules (methods, static and class
    methods, properties' getters)."""
    classes = {id(c): c for _, m in modules for sub in m.modules() for c in type(sub).__mro__}
    found = [
        getattr(value, "__func__", getattr(value, "fget", value))
        for cls in classes.values()
        if _users_own(cls)
        for value in vars(cls).values()
    ]
    return [f for f in found if inspect.isfunction(f)]


def _held_functions(roots: list[Root]) -> list[Callable[..., Any]]:
    """The user's functions the roots hold, or the plain objects they reach (a dict of
    callbacks, a trainer's ``self.on_step``): a bound method as it is (its object is a root
    of its code, :func:`~.python_reach.find_roots`), a ``functools.partial`` too."""
    found = []
    for value in held_values(roots):
        target = value.func if isinstance(value, functools.partial) else value
        function = getattr(target, "__func__", target)
        if inspect.isfunction(function) and _users_own(function):
            found.append(value)
    return found


def unlisted_modules(
    roots: list[Root], modules: Iterable[tuple[str, nn.Module]], known: dict[tuple, Root]
) -> list[Root]:
    """Roots for the modules of the user's (and torch's) classes that ``roots`` lead to,
    hold no tensors and are not (in) ``modules`` (a loss that keeps ``self.calls``, a
    ``CrossEntropyLoss`` whose ``label_smoothing`` changes), those not in ``known``."""
    given = {id(sub) for _, m in modules for sub in m.modules()}
    variables = []
    for root in roots:
        try:
            variables.append((Location(root), root.get()))
        except Exception:  # a cell not yet filled
            continue
    new = []
    for location, module in held(variables, plain_objects(roots).values(), nn.Module):
        key = ("module", id(module))
        if key in known or id(module) in given or not _followed_class(type(module)):
            continue
        if (
            next(iter(module.parameters()), None) is None
            and next(iter(module.buffers()), None) is None
        ):
            new.append(known.setdefault(key, ModuleRoot(location.label, module)))
    return new


def _followed_class(cls: type) -> bool:
    """A module class whose attributes the body's Python state follows where it holds no
    tensors: the user's own, and torch's (a loss's ``label_smoothing`` set between calls)."""
    return _users_own(cls) or cls.__module__.startswith("torch.nn.modules.")


def _users_own(obj: Any) -> bool:
    """A function or class of the user's own files: not of an installed package
    (diffusers', Lightning's: their code is followed where the body calls it, as before)."""
    if not is_user_code(obj):
        return False
    code = getattr(obj, "__code__", None)
    filename = code.co_filename if code is not None else None
    if filename is None:
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        filename = getattr(module, "__file__", None)
    return filename is None or _in_users_files(filename)


@contextlib.contextmanager
def function_attributes_kept(fn: Callable[..., Any], roots: list[Root]) -> Iterator[None]:
    """While a body is traced: the attributes of the user's functions it runs (the body's own
    ``step.calls += 1``, a helper's cache) are not followed, so a change the trace makes to
    them is a :class:`~functacc.TraceError` and put back (before 2026-11-28 it was made at
    the traces only: 2 after 4 calls, silently)."""
    held = [getattr(f, "func", f) for f in _held_functions(roots)]  # a partial's function
    functions = [*_user_functions(*_entry(fn), set()), *(getattr(f, "__func__", f) for f in held)]
    own = {id(f): f for f in functions if _users_own(f)}  # an installed package's: its own
    before = [(f, dict(vars(f))) for f in own.values()]
    try:
        yield
    finally:
        changed = [(f, _changed(vars(f), d)) for f, d in before if _changed(vars(f), d)]
        for f, d in before:
            vars(f).clear()
            vars(f).update(d)
    if changed:
        from ..errors import TraceError

        function, names = changed[0]
        raise TraceError(
            f"the step changes {', '.join(names)} of function {function.__qualname__}: "
            "functacc.jit runs the step's Python once, when it traces, so the change would be "
            "made that once. Fix: keep the value in a dict or an object the step reads "
            "(stats['calls'] += 1: written back after each call), or change it after the call."
        )


def _changed(now: dict, before: dict) -> list[str]:
    """The attributes set, changed or deleted (``.calls``), sorted."""
    names = {k for k in now.keys() | before.keys() if now.get(k, now) is not before.get(k, now)}
    return [f".{k}" for k in sorted(names)]
