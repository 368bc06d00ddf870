"""The library objects a step body holds or is given, put back after a failed trace.

A GradScaler, a scheduler or another library's object: functacc does not scan their code,
so a trace may leave its fake tensors in them (a GradScaler makes its scale at the first
``scale()`` and fills its per-optimizer state in place). :func:`library_objects` notes
their attributes and what the dicts and lists among them hold before a trace;
:func:`restore_objects` puts them back after one that failed or is repeated.

Example:
    >>> import torch
    >>> scaler = torch.amp.GradScaler("cpu")
    >>> saved = library_objects([], [scaler])
    >>> scaler._per_optimizer_states[0]["stage"] = "changed"
    >>> saved.restore()
    >>> dict(scaler._per_optimizer_states)
    {}
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import TraceError, argument_error
from .python_location import Root
from .python_reach import entries, plain_objects

__all__ = [
    "Held",
    "check_declared_optimizers",
    "contents_changed",
    "held_values",
    "library_objects",
    "note_contents",
    "refuse_left_behind",
    "restore_contents",
    "restore_objects",
    "unwrapped",
]


class Held(list):
    """What :func:`library_objects` found: ``(object, its attributes, where)``, and the
    contents of the dicts and lists among them (``contents``: by id, the container and
    its items)."""

    def __init__(self) -> None:
        super().__init__()
        self.contents: dict[int, tuple[Any, list]] = {}

    def restore(self) -> None:
        """Each object's attributes exactly as they were found."""
        restore_objects(self)

    def refuse_left_behind(self) -> None:
        """See :func:`refuse_left_behind`."""
        refuse_left_behind(self)


def library_objects(roots: list[Root], more: Sequence[Any] = ()) -> Held:
    """The objects the body holds (a ``torch.amp.GradScaler``, a scheduler, a trainer and
    the logger it keeps) or is given (``more``: the call's arguments), reached through
    attributes and containers a few levels deep, each with a copy of its attributes and
    where it was found. A library's code is not scanned, so a trace may leave fake tensors
    or symbols in them (GradScaler makes its scale at the first ``scale()``; a meter's
    ``update(loss.item())``); :func:`restore_objects` puts back what they held before."""
    frontier: list[tuple[str, Any, int]] = [(f"argument {i}", v, 0) for i, v in enumerate(more)]
    for root in roots:
        try:
            frontier.append((root.label, root.get(), 0))
        except Exception:  # a cell not yet filled, a global not yet defined
            continue
    saved = Held()
    seen: set[int] = set()
    while frontier and len(seen) < _BUDGET:
        label, value, depth = frontier.pop(0)
        if id(value) in seen or depth > _DEPTH:
            continue
        seen.add(id(value))
        if type(value) in (list, tuple, collections.deque) and len(value) <= _WIDE:
            frontier += [(f"{label}[{i}]", v, depth + 1) for i, v in enumerate(value)]
        elif isinstance(value, dict) and len(value) <= _WIDE:
            frontier += [(f"{label}[{k!r}]", v, depth + 1) for k, v in dict.items(value)]
        elif _object(value):
            saved.append((value, dict(vars(value)), label))
            for v in vars(value).values():
                note_contents(v, saved.contents)
            frontier += [(f"{label}.{k}", v, depth + 1) for k, v in vars(value).items()]
    return saved


_DEPTH, _BUDGET, _WIDE = 6, 2048, 256  # how far library_objects looks


def _object(value: Any) -> bool:
    """An object whose attributes a trace may change: not a tensor, a module, an optimizer,
    a generator (the capture's), functacc's own, a function, a class or a Python module."""
    if not isinstance(getattr(value, "__dict__", None), dict):
        return False
    if isinstance(value, (Tensor, nn.Module, torch.optim.Optimizer, torch.Generator)):
        return False
    if type(value).__module__.startswith("functacc."):  # another jitted step, its engine
        return False
    return not (inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value))


def refuse_left_behind(saved: list[tuple[Any, dict, str]]) -> None:
    """After a trace that succeeded: a :class:`TraceError` for values of the trace (symbols, fake
    tensors, a formatted number's token) that a call into code functacc does not follow left
    in the objects (timm's ``AverageMeter.update(loss.item(), n)``), all put back first."""
    for value, _, label in saved:
        for name, v in vars(value).items():
            found = _traced(v)
            if found is not None:
                restore_objects(saved)
                raise TraceError(
                    f"the step left a value of its trace ({found}) in {label}.{name} "
                    f"({type(value).__name__}): a call in the step into code functacc.jit "
                    "does not follow (a library's) stored it. That call runs once, when the "
                    "step is traced, where eager runs it on every call. Fix: make the call "
                    "after the step with values the step returns (return loss.item(); then "
                    "meter.update(loss, n)); nothing was changed."
                )


def _traced(value: Any, depth: int = 0) -> str | None:
    """What of a trace ``value`` holds, a few containers deep, if anything."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"the symbol {value}"
    if isinstance(value, Tensor) and type(value) not in (Tensor, nn.Parameter, nn.Buffer):
        return f"a traced {type(value).__name__}"
    if isinstance(value, str) and "\x00functacc" in value:
        return "a number formatted while traced"
    if depth < 3 and type(value) in (list, tuple, collections.deque, dict):
        items = dict.values(value) if isinstance(value, dict) else value
        return next((t for t in map(lambda v: _traced(v, depth + 1), items) if t), None)
    return None


def note_contents(value: Any, contents: dict[int, tuple[Any, list]], depth: int = 0) -> None:
    """The items of ``value`` and of the dicts and lists in it, a few levels deep (a
    GradScaler's per-optimizer state dicts are filled in place), each container by id."""
    if depth > 3 or type(value) not in _CONTAINERS or id(value) in contents:
        return
    contents[id(value)] = (value, _items(value))
    for v in dict.values(value) if isinstance(value, dict) else value:
        note_contents(v, contents, depth + 1)


def _items(container: Any) -> list:
    return list(dict.items(container)) if isinstance(container, dict) else list(container)


def contents_changed(contents: dict[int, tuple[Any, list]]) -> bool:
    """Whether a container :func:`note_contents` saw holds other items now (by identity:
    an entry set again keeps its key object)."""
    for container, items in contents.values():
        now = _items(container)
        if len(now) != len(items):
            return True
        pairs = zip(now, items, strict=True)
        if isinstance(container, dict):
            if any(a[0] is not b[0] or a[1] is not b[1] for a, b in pairs):
                return True
        elif any(a is not b for a, b in pairs):
            return True
    return False


def restore_contents(contents: dict[int, tuple[Any, list]]) -> None:
    """Each container :func:`note_contents` saw, in place, holding what it held then."""
    for container, items in contents.values():
        if isinstance(container, dict):
            dict.clear(container)
            dict.update(container, items)
        else:
            container.clear()
            container.extend(items)


_CONTAINERS = (dict, list, collections.defaultdict, collections.deque)


def restore_objects(saved: Held) -> None:
    """Each object's attributes exactly as :func:`library_objects` saw them: the same
    objects, the dicts and lists among them holding what they held (in place: a list held
    under two names, ``self.master_params = self.model_params``, stays one list)."""
    for value, attributes, _ in saved:
        current = vars(value)
        for name in [n for n in current if n not in attributes]:
            del current[name]
        current.update(attributes)
    restore_contents(saved.contents)


def held_values(roots: list[Root]) -> list[Any]:
    """What the body holds: its roots' values (closure cells, globals, ``self``), and the
    attributes and items of the plain objects it reaches (a trainer's ``self.opt``)."""
    values = []
    for root in roots:
        try:
            values.append(root.get())
        except Exception:  # a cell not yet filled
            continue
    for _, value in plain_objects(roots).values():
        values.extend(v for _, _, v in entries(value))
    return values


def unwrapped(o: Any) -> Any:
    """The optimizer ``o`` wraps as ``o.optimizer`` (Hugging Face Accelerate's
    ``AcceleratedOptimizer``, an ``Optimizer`` subclass that does not run its
    ``__init__``, delegating ``param_groups``, ``state`` and ``step()``), else ``o``."""
    inner = getattr(o, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" not in vars(o):
        return inner
    return o


def check_declared_optimizers(
    roots: list[Root], declared: Sequence[Any], modules: Sequence[nn.Module]
) -> None:
    """Refuse a body that holds an optimizer of its modules' parameters that is not in
    ``optimizers=``, also one a module keeps as an attribute (pytorch/examples'
    forward-forward layers: ``self.opt``). Unlisted, its ``zero_grad()`` and ``step()`` act
    on the parameters themselves, once, at the trace: the traced step never updated them
    (their ``.grad`` is ``None`` then, so ``step()`` skipped them), silently."""
    ids = {id(p) for m in modules for p in m.parameters()}
    known = {id(d) for d in declared}
    kept = [
        (v, f" (a {type(sub).__name__}'s .{name})")
        for m in modules
        for sub in m.modules()
        for name, v in vars(sub).items()
    ]
    for value, where in [(v, "") for v in held_values(roots)] + kept:
        if not isinstance(value, torch.optim.Optimizer) or id(unwrapped(value)) in known:
            continue
        if not any(id(p) in ids for group in value.param_groups for p in group["params"]):
            continue
        if isinstance(value, torch.optim.LBFGS):  # optimizers= refuses it: its step() loops
            from .own_step import LBFGS_ADVICE

            raise argument_error(
                "the step body holds a torch.optim.LBFGS of its modules' parameters (an "
                "LBFGS closure that calls opt.zero_grad()?), whose zero_grad() would act on "
                f"the parameters once, while traced, not on every call. Fix: {LBFGS_ADVICE}"
            )
        raise argument_error(
            f"the step body holds a {type(value).__name__}{where} of its modules' "
            "parameters that is not in optimizers=: its zero_grad() and step() would act on the "
            "parameters themselves once, while traced, not on every call (eager steps "
            "every call). Fix: pass it in optimizers=(...), also when its step() runs "
            "after the jitted function."
        )
