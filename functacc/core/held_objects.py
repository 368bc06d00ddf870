"""The library objects a step body holds or is given, put back after a failed trace.

A GradScaler, a scheduler or another library's object: functacc does not scan their code,
so a trace may leave its fake tensors in them (a GradScaler makes its scale at the first
``scale()`` and fills its per-optimizer state in place). :func:`library_objects` copies
their attributes (dicts and lists copied, everything else kept as the same object) before
a trace; :func:`restore_objects` puts them back after one that failed or is repeated.

Example:
    >>> import torch
    >>> scaler = torch.amp.GradScaler("cpu")
    >>> saved = library_objects([], [scaler])
    >>> scaler._per_optimizer_states[0]["stage"] = "changed"
    >>> restore_objects(saved)
    >>> dict(scaler._per_optimizer_states)
    {}
"""

from __future__ import annotations

import collections
import copy
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import argument_error
from .python_location import Root
from .python_reach import entries, is_plain_object, plain_objects

__all__ = [
    "check_declared_optimizers",
    "held_values",
    "library_objects",
    "restore_objects",
    "unwrapped",
]


def library_objects(roots: list[Root], more: Sequence[Any] = ()) -> list[tuple[Any, dict]]:
    """The library objects the body holds directly (a ``torch.amp.GradScaler``, a
    scheduler) or is given (``more``: the call's arguments), each with a copy of its
    attributes. Their code is not scanned, so a trace may leave fake tensors in them
    (GradScaler makes its scale at the first ``scale()``); :func:`restore_objects` puts
    back what they held before the trace."""
    values = list(more)
    for root in roots:
        try:
            values.append(root.get())
        except Exception:  # a cell not yet filled, a global not yet defined
            continue
    saved, seen = [], set()
    for value in values:
        if id(value) in seen or is_plain_object(value) or not hasattr(value, "__dict__"):
            continue
        if isinstance(value, (Tensor, nn.Module, torch.optim.Optimizer, torch.Generator)):
            continue
        if inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value):
            continue
        seen.add(id(value))
        saved.append((value, _containers_copied(vars(value))))
    return saved


def _containers_copied(value: Any, depth: int = 0) -> Any:
    """``value`` with its dicts and lists copied (a GradScaler's per-optimizer state dicts
    are filled in place) down to a few levels; everything else kept as the same object (a
    scheduler's optimizer stays that optimizer)."""
    if depth > 3 or type(value) not in (dict, list, collections.defaultdict):
        return value
    if isinstance(value, list):
        return [_containers_copied(v, depth + 1) for v in value]
    copied = copy.copy(value)  # a defaultdict keeps its default factory
    for k, v in value.items():
        copied[k] = _containers_copied(v, depth + 1)
    return copied


def restore_objects(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    """Each object's attributes exactly as :func:`library_objects` saw them."""
    for value, attributes in saved:
        current = vars(value)
        for name in [n for n in current if n not in attributes]:
            del current[name]
        current.update(_containers_copied(attributes))


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
    roots: list[Root], declared: Sequence[Any], params: Iterable[Tensor]
) -> None:
    """Refuse a body that holds an optimizer of its modules' parameters that is not in
    ``optimizers=``. Unlisted, its ``zero_grad()`` and ``step()`` act on the
    parameters themselves, once, at the trace: the traced step never updated them (their
    ``.grad`` is ``None`` then, so ``step()`` skipped them), silently."""
    ids = {id(p) for p in params}
    known = {id(d) for d in declared}
    for value in held_values(roots):
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
            f"the step body holds a {type(value).__name__} of its modules' parameters "
            "that is not in optimizers=: its zero_grad() and step() would act on the "
            "parameters themselves once, while traced, not on every call (eager steps "
            "every call). Fix: pass it in optimizers=(...), also when its step() runs "
            "after the jitted function."
        )
