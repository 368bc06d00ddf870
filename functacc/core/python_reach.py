"""Where a step body's Python reads and writes: its roots, and locations reached from them.

A jitted body runs its Python once per trace. What it reads outside tensors — a closure
variable, a global, an attribute of the trainer object it is a method of, an entry of a
config dict — is baked into the graph; what it writes there happens once. To do better, the
step must know where those values live. The body's code says it: its free variables (closure
cells), the globals it names (``co_names``, also those assigned only later), its parameters'
defaults, ``self`` for a bound method or a callable object, and the same for the functions
it defines, the user functions it calls by name, the methods it calls on plain objects and
the functions of user modules it calls (``logger.logkv_mean(...)``). Those are the *roots*
(:mod:`.python_location`); a location is a root followed by attribute and item steps
(``self.cfg.scale``, ``state['step']``, ``Logger.CURRENT``), read afresh on every call.

Plain objects and dicts reached from the roots (a trainer, a config, a ``SimpleNamespace``,
a user class's attributes) are recorded exactly while the body is traced
(:mod:`.python_recording`).

Example:
    >>> config = types.SimpleNamespace(lr=0.1)
    >>> is_plain_object(config), is_plain_object(torch.nn.Linear(1, 1))
    (True, False)
"""

from __future__ import annotations

import builtins
import collections
import dis
import enum
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .python_location import MISSING, Location, ModuleRoot, Root, fields_of, slot_names

__all__ = [
    "MEMOIZED",
    "MODULE_TABLES",
    "entries",
    "find_roots",
    "held",
    "holds_traced",
    "is_plain_object",
    "is_scalar",
    "is_user_code",
    "plain_objects",
]


# Libraries whose functions are not the user's step code (not scanned for the names they
# read), and whose objects are not the user's Python state (not recorded).
_LIBRARIES = frozenset(
    (  # noqa: SIM905 (a list of names, one line)
        "torch functacc numpy logging threading multiprocessing concurrent asyncio queue io "
        "socket weakref tqdm wandb tensorboard tensorboardX mlflow transformers timm"
    ).split()
)
# Libraries of models and training utilities whose objects that hold only numbers are state
# the body keeps (timm's AverageMeter, updated with loss.item()): recorded as a user's are.
_MODEL_LIBRARIES = frozenset(("timm", "transformers"))
_CONTAINERS = (dict, list, collections.defaultdict, collections.deque)  # python_recording
_SCAN_DEPTH = 3  # called user functions followed this many calls deep
_OBJECT_DEPTH = 3  # plain objects reached this many attributes deep from a root
_MAX_OBJECTS = 256
MEMOIZED = functools._lru_cache_wrapper  # what functools.lru_cache and functools.cache make


# -- what the body's code names -------------------------------------------------------------
def find_roots(fn: Callable[..., Any], known: dict[tuple, Root] | None = None) -> list[Root]:
    """The closure cells, globals, parameter defaults and ``self`` that ``fn``'s code (and
    the code of the functions it defines and the user functions it calls by name) can read;
    those not in ``known`` (by where they are: a cell a hook shares with the body is one)."""
    roots: dict[tuple, Root] = {} if known is None else known
    before = set(roots)
    target, owner = _entry(fn)
    if owner is not None and is_plain_object(owner):
        roots.setdefault(("self", id(owner)), Root("self", lambda: owner, None))
    for function in _user_functions(target, owner, set()):
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
            elif _own_module(module_globals.get(name)):  # import cfg; cfg.steps += 1: its
                table = vars(module_globals[name])  # attributes the code names are globals
                for attr in _names(code) & {k for k, v in table.items() if _watchable(v)}:
                    roots.setdefault(("global", id(table), attr), _global_root(attr, table))
                    roots[("global", id(table), attr)].loaded = True
    return [root for key, root in roots.items() if key not in before]


def _entry(fn: Callable[..., Any]) -> tuple[Any, Any]:
    """The function where ``fn``'s user code starts, and the object it is a method of."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    target = getattr(target, "functacc_user_code", target)  # compile_step's loss_fn
    owner = getattr(target, "__self__", None)
    plain_call = not inspect.isfunction(target) and not inspect.ismethod(target)
    if owner is None and plain_call and is_plain_object(target):
        owner, target = target, type(target).__call__
    return target, owner


def _user_functions(
    fn: Any, owner: Any, seen: set[int], depth: int = 0
) -> Iterator[types.FunctionType]:
    function = getattr(fn, "__func__", fn)
    if not inspect.isfunction(function) or id(function) in seen or not is_user_code(function):
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
            if isinstance(value, MEMOIZED):  # run uncached while traced (python_memo.py)
                value = value.__wrapped__
            if inspect.isfunction(value) or inspect.ismethod(value):
                yield from _user_functions(value, owner, seen, depth + 1)
            elif value is not owner and is_plain_object(value):  # logger.log(...): its code
                for method in names:
                    found = inspect.getattr_static(type(value), method, None)
                    yield from _user_functions(found, value, seen, depth + 1)
            elif inspect.ismodule(value) and is_user_code(value):  # logger.logkv_mean(...)
                for attr in names:
                    yield from _user_functions(vars(value).get(attr), None, seen, depth + 1)


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


def is_user_code(obj: Any) -> bool:
    """A function, class or module (or a module's name) of the user's code: not of a
    library, not of Python's."""
    module = obj if isinstance(obj, str) else getattr(obj, "__module__", None) or obj.__name__
    top = (module or "").split(".")[0]
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


def _own_module(value: Any) -> bool:
    """A module of the user's own files (not of an installed package or Python's)."""
    from .python_output import is_user_code as in_users_files

    path = getattr(value, "__file__", None)
    return inspect.ismodule(value) and bool(path) and is_user_code(value) and in_users_files(path)


def _watchable(value: Any) -> bool:
    return not (
        inspect.ismodule(value)
        or (inspect.isclass(value) and not is_user_code(value))  # a user's: its attributes
        or inspect.isroutine(value)
        or isinstance(value, (functools.partial, types.MethodType))
    )


# -- what a value is ----------------------------------------------------------------------
# NumPy's scalars too (np.int64: a count the step keeps with np.sum), not its object ones.
_SCALARS = (int, float, bool, str, bytes, type(None), complex, enum.Enum, torch.dtype, np.number,
            np.bool_)  # fmt: skip


def is_scalar(value: Any) -> bool:
    """A value a trace bakes in and a signature can hold: numbers, strings, ``None``,
    enums, dtypes, and tuples (named ones too) and sets of them."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (set, frozenset)):  # guarded by its contents
        return all(is_scalar(v) for v in value)
    named = isinstance(value, tuple) and hasattr(type(value), "_fields")  # a namedtuple
    return (type(value) is tuple or named) and all(is_scalar(v) for v in value)


def is_plain_object(value: Any) -> bool:
    """A user's Python object whose attributes are step state (a trainer, a config): not a
    tensor, module, optimizer, scheduler, generator, function, class or library object."""
    if isinstance(value, (Tensor, nn.Module, torch.optim.Optimizer, torch.Generator)):
        return False
    if isinstance(value, (*_SCALARS, list, dict, tuple, set, frozenset)):
        return False
    if inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value):
        return False
    if not hasattr(value, "__dict__") and not (slot_names(type(value)) and is_user_code(value)):
        return False  # a class of the user's with __slots__ only: followed (pathlib's: not)
    top = (type(value).__module__ or "").split(".")[0]
    if top in _MODEL_LIBRARIES:  # a meter of theirs (timm's AverageMeter): numbers only
        return all(isinstance(v, (int, float)) for v in vars(value).values())
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
        if _walked(value):
            found[id(value)] = (location, value)
            entries = dict.items(value) if isinstance(value, dict) else enumerate(value)
            if depth < _OBJECT_DEPTH and len(value) <= 64:
                frontier.extend(
                    (location.child("item", k), v, depth + 1)
                    for k, v in entries
                    if _containerish(v)
                )
        elif is_plain_object(value) or _is_user_class(value) or _followed(location, value):
            found[id(value)] = (location, value)  # Logger.CURRENT: a class's
            if depth < _OBJECT_DEPTH:
                frontier.extend(
                    (location.child("attr", k), v, depth + 1)
                    for k, v in fields_of(value).items()
                    if _containerish(v) and k not in MODULE_TABLES and k[:2] != "__"
                )  # a class's __annotations__ is Python's, not the step's
    return found


def entries(obj: Any) -> list[tuple[str, Any, Any]]:
    """What a dict, list, deque or plain object (as :func:`plain_objects` finds them) holds,
    as ``(kind, key, value)``: ``"item"`` entries of a container, ``"attr"`` of an object."""
    if isinstance(obj, dict):  # dict's own items: a recording copy's are not reads
        return [("item", k, v) for k, v in dict.items(obj)]
    if isinstance(obj, (list, collections.deque)):
        return [("item", i, v) for i, v in enumerate(obj)]
    return [("attr", k, v) for k, v in fields_of(obj).items()]


def held(
    variables: Iterable[tuple[Location, Any]],
    objects: Iterable[tuple[Location, Any]],
    kinds: type | tuple[type, ...],
) -> list[tuple[Location, Any]]:
    """The values of ``kinds`` the body's ``variables`` (each root's location and value) and
    the plain objects, dicts and lists it reaches (``objects``, as :func:`plain_objects`
    finds them) hold, each with its location (a value held in two places: twice)."""
    found = list(variables)
    for location, obj in objects:
        found += [(location.child(kind, k), v) for kind, k, v in entries(obj)]
    return [(location, v) for location, v in found if isinstance(v, kinds)]


MODULE_TABLES = frozenset(vars(nn.Module()))
"""A module's own attributes: its tables and hooks (its tensors are the capture's, not
Python state)."""


def _followed(location: Location, value: Any) -> bool:
    """A module whose attributes the body writes, at its own root (python_state)."""
    return isinstance(location.root, ModuleRoot) and not location.steps


def _walked(value: Any) -> bool:
    """A container :func:`plain_objects` walks: a dict, list or deque, or a dict of a class
    of its own (a ``Counter``, an ``OrderedDict``; not functacc's recording copies)."""
    if type(value) in _CONTAINERS:
        return True
    return isinstance(value, dict) and not type(value).__module__.startswith("functacc.")


def _containerish(value: Any) -> bool:
    if _walked(value):
        return True
    return is_plain_object(value) or _is_user_class(value)


def _is_user_class(value: Any) -> bool:
    """A class of the user's code (a module's too: its class attributes, not the model's)."""
    return inspect.isclass(value) and value is not nn.Module and is_user_code(value)


def holds_traced(value: Any, depth: int = 0) -> bool:
    """Whether a plain object holds a traced value, in its containers too (a logger's
    ``defaultdict`` of means), a few levels deep."""
    if isinstance(value, (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if depth > 3:
        return False
    if isinstance(value, (dict, list, tuple, collections.deque)):
        items = value.values() if isinstance(value, dict) else value
    else:
        items = vars(value).values() if is_plain_object(value) else ()
    return any(holds_traced(v, depth + 1) for v in items)
