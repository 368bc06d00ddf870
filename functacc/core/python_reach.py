"""Where a step body's Python reads and writes: its roots, and locations reached from them.

A jitted body runs its Python once per trace. What it reads outside tensors — a closure
variable, a global, an attribute of the trainer object it is a method of, an entry of a
config dict — is baked into the graph; what it writes there happens once. To do better, the
step must know where those values live. The body's code says it: its free variables (closure
cells), the globals it names (``co_names``), its parameters' defaults, ``self`` for a bound
method or a callable object, and the same for the functions it defines and the user
functions it calls by name. Those are the *roots*; a :class:`Location` is a root followed
by attribute and item steps (``self.cfg.scale``, ``state['step']``), read afresh on every
call.

Plain objects and dicts reached from the roots (a trainer, a config, a ``SimpleNamespace``)
are recorded exactly while the body is traced (:mod:`.python_recording`).

Example:
    >>> config = {"scale": 0.5}
    >>> root = Root("global config", lambda: config, None)
    >>> Location(root, (("item", "scale"),)).get()
    0.5
    >>> Location(root, (("item", "scale"),)).label
    "global config['scale']"
"""

from __future__ import annotations

import builtins
import dis
import enum
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "MISSING",
    "Location",
    "Root",
    "find_roots",
    "is_plain_object",
    "is_scalar",
    "plain_objects",
]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
"""What a location holds when its attribute, item or variable does not exist."""

# Libraries whose functions are not the user's step code (not scanned for the names they
# read), and whose objects are not the user's Python state (not recorded).
_LIBRARIES = frozenset(
    (  # noqa: SIM905 (a list of names, one line)
        "torch functacc numpy logging threading multiprocessing concurrent asyncio queue io "
        "socket weakref tqdm wandb tensorboard tensorboardX mlflow transformers timm"
    ).split()
)
_SCAN_DEPTH = 3  # called user functions followed this many calls deep
_OBJECT_DEPTH = 3  # plain objects reached this many attributes deep from a root
_MAX_OBJECTS = 256


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


class Location:
    """A root and a path of ``("attr", name)`` / ``("item", key)`` steps from it."""

    __slots__ = ("label", "root", "steps")

    def __init__(self, root: Root, steps: tuple[tuple[str, Any], ...] = ()):
        self.root = root
        self.steps = steps
        self.label = root.label + "".join(
            f".{k}" if kind == "attr" else ".__len__()" if kind == "len" else f"[{k!r}]"
            for kind, k in steps
        )

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
        if kind == "attr":
            object.__setattr__(parent, key, value)
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
        if kind == "attr":
            vars(parent).pop(key, None)
        else:
            parent.pop(key, None)

    def __repr__(self) -> str:
        return f"Location({self.label})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and self.root is other.root and self.steps == other.steps

    def __hash__(self) -> int:
        return hash((id(self.root), self.steps))


def _step(value: Any, kind: str, key: Any) -> Any:
    if kind == "len":
        return len(value) if isinstance(value, (list, dict)) else MISSING
    if kind == "attr":
        fields = getattr(value, "__dict__", None)
        return fields.get(key, MISSING) if fields is not None else MISSING
    try:
        return value[key]
    except (KeyError, IndexError, TypeError):
        return MISSING


# -- what the body's code names -------------------------------------------------------------
def find_roots(fn: Callable[..., Any]) -> list[Root]:
    """The closure cells, globals, parameter defaults and ``self`` that ``fn``'s code (and
    the code of the functions it defines and the user functions it calls by name) can read."""
    roots: dict[tuple, Root] = {}
    seen: set[int] = set()
    target = fn.func if isinstance(fn, functools.partial) else fn
    target = getattr(target, "functacc_user_code", target)  # compile_step's loss_fn
    owner = getattr(target, "__self__", None)
    plain_call = not inspect.isfunction(target) and not inspect.ismethod(target)
    if owner is None and plain_call and is_plain_object(target):
        owner, target = target, type(target).__call__
    if owner is not None and is_plain_object(owner):
        roots[("self",)] = Root("self", lambda: owner, None)
    for function in _user_functions(target, owner, seen):
        code = function.__code__
        loaded = _loaded(code)
        for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=True):
            root = roots.setdefault(("cell", id(cell)), _cell_root(name, cell))
            root.loaded = root.loaded or name in loaded
        for key, root in _default_roots(function):  # def step(x, meter=meter)
            roots.setdefault(key, root)
        module_globals = function.__globals__
        # A global the code reads or assigns that is not defined yet (``b_obs = ...`` each
        # iteration, after jit()) is a root too: it holds a value by the time the step runs.
        later = _loaded(code, _GLOBAL_OPS) - module_globals.keys() - vars(builtins).keys()
        for name in _names(code):
            if name in later or (name in module_globals and _watchable(module_globals[name])):
                key = ("global", id(module_globals), name)
                root = roots.setdefault(key, _global_root(name, module_globals))
                root.loaded = root.loaded or name in loaded
    return list(roots.values())


def _user_functions(
    fn: Any, owner: Any, seen: set[int], depth: int = 0
) -> Iterator[types.FunctionType]:
    function = getattr(fn, "__func__", fn)
    if not inspect.isfunction(function) or id(function) in seen or not _is_user(function):
        return
    seen.add(id(function))
    yield function
    if depth >= _SCAN_DEPTH:
        return
    code = function.__code__
    cells = dict(zip(code.co_freevars, function.__closure__ or (), strict=True))
    scopes: list[Callable[[str], Any]] = [
        lambda n: function.__globals__.get(n, MISSING),
        lambda n: _cell_value(cells[n]) if n in cells else MISSING,
    ]
    if owner is not None:
        scopes.append(lambda n: inspect.getattr_static(owner, n, MISSING))
    names = _names(code)
    for name in names | set(cells):
        for scope in scopes:
            value = scope(name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or inspect.ismethod(value):
                yield from _user_functions(value, owner, seen, depth + 1)
            elif value is not owner and is_plain_object(value):  # logger.log(...): its code
                for method in names:
                    found = inspect.getattr_static(type(value), method, None)
                    yield from _user_functions(found, value, seen, depth + 1)


def _names(code: types.CodeType) -> set[str]:
    """The names a code object and the code objects nested in it read."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


_LOAD_OPS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF")
_GLOBAL_OPS = ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")


def _loaded(code: types.CodeType, ops: tuple[str, ...] = _LOAD_OPS) -> set[str]:
    """The global and closure variables a code object (and those nested in it) reads (or,
    given other ``ops``, uses as those say)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ops}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loaded(const, ops)
    return names


def _is_user(function: types.FunctionType) -> bool:
    module = getattr(function, "__module__", None) or ""
    top = module.split(".")[0]
    return top not in _LIBRARIES and top not in sys.stdlib_module_names


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not yet assigned
        return MISSING


def _cell_root(name: str, cell: types.CellType) -> Root:
    def set_(value: Any) -> None:
        if value is MISSING:
            del cell.cell_contents
        else:
            cell.cell_contents = value

    return Root(f"closure variable {name!r}", lambda: _cell_value(cell), set_, loaded=False)


def _default_roots(function: types.FunctionType) -> Iterator[tuple[tuple, Root]]:
    """Its parameters' default values: read at every call that leaves the argument out."""
    names = function.__code__.co_varnames[: function.__code__.co_argcount]
    places = list(enumerate(names[len(names) - len(function.__defaults__ or ()) :]))
    for i, name in [*places, *((None, n) for n in function.__kwdefaults__ or {})]:
        root = _default_root(function, name, i)
        if _watchable(root.get()):
            yield ("default", id(function), name), root


def _default_root(function: types.FunctionType, name: str, i: int | None) -> Root:
    def get() -> Any:
        return function.__kwdefaults__[name] if i is None else function.__defaults__[i]

    def set_(value: Any) -> None:
        if i is None:
            function.__kwdefaults__[name] = value
            return
        values = list(function.__defaults__)
        values[i] = value
        function.__defaults__ = tuple(values)

    return Root(f"default of {name!r}", get, set_)


def _global_root(name: str, module_globals: dict[str, Any]) -> Root:
    def set_(value: Any) -> None:
        if value is MISSING:
            module_globals.pop(name, None)
        else:
            module_globals[name] = value

    module = module_globals.get("__name__", "?")
    return Root(
        f"global {module}.{name}", lambda: module_globals.get(name, MISSING), set_, loaded=False
    )


def _watchable(value: Any) -> bool:
    return not (
        inspect.ismodule(value)
        or inspect.isclass(value)
        or inspect.isroutine(value)
        or isinstance(value, (functools.partial, types.MethodType))
    )


# -- what a value is ----------------------------------------------------------------------
_SCALARS = (int, float, bool, str, bytes, type(None), complex, enum.Enum, torch.dtype)


def is_scalar(value: Any) -> bool:
    """A value a trace bakes in and a signature can hold: numbers, strings, ``None``,
    enums, dtypes, and tuples of them."""
    if isinstance(value, _SCALARS):
        return True
    return type(value) is tuple and all(is_scalar(v) for v in value)


def is_plain_object(value: Any) -> bool:
    """A user's Python object whose attributes are step state (a trainer, a config): not a
    tensor, module, optimizer, scheduler, generator, function, class or library object."""
    if isinstance(value, (Tensor, nn.Module, torch.optim.Optimizer, torch.Generator)):
        return False
    if isinstance(value, (*_SCALARS, list, dict, tuple, set, frozenset)):
        return False
    if inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value):
        return False
    if not hasattr(value, "__dict__"):
        return False
    top = (type(value).__module__ or "").split(".")[0]
    return top not in _LIBRARIES


def plain_objects(roots: list[Root]) -> dict[int, tuple[Location, Any]]:
    """The plain objects, dicts and lists reachable from ``roots`` through attributes and
    entries, each once, with the first location it was found at (breadth first)."""
    found: dict[int, tuple[Location, Any]] = {}
    frontier = [(Location(r), r.get(), 0) for r in roots]
    while frontier and len(found) < _MAX_OBJECTS:
        location, value, depth = frontier.pop(0)
        if id(value) in found:
            continue
        if isinstance(value, (dict, list)) and type(value) in (dict, list):
            found[id(value)] = (location, value)
            entries = value.items() if isinstance(value, dict) else enumerate(value)
            if depth < _OBJECT_DEPTH and len(value) <= 64:
                frontier.extend(
                    (location.child("item", k), v, depth + 1)
                    for k, v in entries
                    if _containerish(v)
                )
        elif is_plain_object(value):
            found[id(value)] = (location, value)
            if depth < _OBJECT_DEPTH:
                frontier.extend(
                    (location.child("attr", k), v, depth + 1)
                    for k, v in vars(value).items()
                    if _containerish(v)
                )
    return found


def _containerish(value: Any) -> bool:
    return (type(value) in (dict, list)) or is_plain_object(value)
