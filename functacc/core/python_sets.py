"""Sets, optimizers and schedulers a traced step reaches, beyond what it records.

A ``set`` the body reads (``if name in self.frozen:``) is guarded by its contents, as a
tuple of numbers is (:func:`~.python_reach.is_scalar`): one changed between calls traces
again. A set the body changes (``seen.add(k)``) cannot be replayed: what the body read of
it is unseen (CPython's set methods do not go through Python), so a trace would fix it.
The change is a clear error advising a dict (``seen[k] = True``, replayed after each call)
and the set is put back as it was: before, the add happened once, at the trace.

Where the body reads a module, an optimizer, a scheduler, a grad scaler or a
``torch.Generator`` (a closure variable, a dict entry, an attribute), the object is guarded
by identity (:func:`by_identity`): the trace ran its code and steps it, so another object
there (a scheduler replaced between calls, ``sched = CosineAnnealingLR(opt, ...)`` after a
warm-up) traces again (before: the old one went on being stepped, silently). One with
tensors that the step makes and keeps for later calls is refused
(:func:`refuse_made_in_step`).

An optimizer's or a scheduler's attributes are compared after the trace
(:data:`STEPPERS`): one the body wrote is replayed after each call, a number it read and
wrote is fed as a counter is (before: written once, at the trace; a ``loss.item()`` left
the trace's symbol there).

Example:
    >>> from functacc.core.python_location import Location, Root
    >>> seen = {1}
    >>> watch = SetWatch([(Location(Root("seen", lambda: seen, None)), seen)])
    >>> seen.add(2)
    >>> watch.check()
    Traceback (most recent call last):
    functacc.errors.TraceError: the step changes the set seen. ...
    >>> watch.restore()
    >>> seen
    {1}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from .lookup_tables import is_array
from .python_location import Location
from .python_reach import is_scalar

__all__ = ["STEPPERS", "SetWatch", "by_identity", "is_guarded", "refuse_made_in_step"]

STEPPERS = (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)
"""Library objects whose attributes a body may write (``opt.my_count += 1``): compared after
each trace, their writes replayed, and not guarded (a scheduler's ``last_epoch`` moves on
every call; the body's reads of them are fixed at the trace, as before)."""
_BY_IDENTITY = (*STEPPERS, nn.Module, torch.amp.GradScaler, torch.Generator)


def is_guarded(value: Any) -> bool:
    """What a trace bakes in where the body reads it, so a signature guards it: a scalar, a
    NumPy array (by its contents), what :func:`by_identity` names (by identity)."""
    return is_scalar(value) or is_array(value) or by_identity(value)


def refuse_made_in_step(value: Any, where: str, recorder: Any) -> None:
    """Refuse to keep, at ``where``, a module with tensors or an optimizer that the step
    made (``self.ema = copy.deepcopy(model)``, an optimizer made at the first call): it holds
    the trace's tensors, and as a constant every later call would find that one object,
    stale. One that existed before the trace is only moved or passed: kept as it is (held
    by the body's state then, or a module holding the step's own tensors, or one of the
    step's optimizers)."""
    if not isinstance(value, (nn.Module, torch.optim.Optimizer)):
        return
    if isinstance(value, nn.Module):
        tensors = list(value.state_dict(keep_vars=True).values())
        if not tensors:
            return  # no tensors (a loss made at the first call): eager's one object too
        own = set(recorder.owned) | {id(t) for t in getattr(recorder, "stand_in", {}).values()}
        if any(id(t) in own for t in tensors):
            return
    elif any(value is linked.optimizer for linked in recorder.optimizers):
        return
    roots = [v for _, v in recorder.root_values]
    before = [*roots, *(v for _, _, c in recorder.snapshots for v in _values(c))]
    if any(v is value for b in before for v in _with_inside(b)):
        return
    kind = "optimizer" if isinstance(value, torch.optim.Optimizer) else "module"
    raise TraceError(
        f"{where} is {type(value).__name__}(...), which the step makes while traced, holding "
        f"the trace's tensors: functacc.jit cannot keep that {kind} for the calls after, as eager "
        f"keeps the one its first call made. Fix: make it before the first call (an EMA copy "
        f"or an optimizer: where the model is made) and give it in "
        f"{'optimizers' if kind == 'optimizer' else 'modules'}=(...)."
    )


def _values(contents: Any) -> list:
    return list(contents.values()) if isinstance(contents, dict) else list(contents)


def _with_inside(value: Any) -> list:
    return list(value.modules()) if isinstance(value, nn.Module) else [value]


def by_identity(value: Any) -> bool:
    """A module, optimizer, scheduler (torch's, timm's), grad scaler or torch generator."""
    return isinstance(value, _BY_IDENTITY) or str(type(value).__module__).startswith(
        "timm.scheduler."
    )


class SetWatch:
    """The contents of the sets a trace may change, to put back and compare."""

    def __init__(self, sets: list[tuple[Location, set]]):  # python_reach.held(..., set)
        self.sets = [(location, s, set(s)) for location, s in sets]
        self.first: str | None = None

    def restore(self) -> None:
        """Put every set back as it was; note the first that had changed."""
        for location, now, before in self.sets:
            if now != before:
                self.first = self.first or location.label
                now.clear()
                now.update(before)

    def check(self) -> None:
        """Raise the error for a step that changed a set."""
        for location, now, before in self.sets:
            if now != before:
                self.first = self.first or location.label
        if self.first is not None:
            raise TraceError(
                f"the step changes the set {self.first}. functacc.jit replays a step's "
                "writes after each call, but not a set's: what the step read of it would be "
                "fixed when traced. Fix: keep a dict (seen[k] = True, and `k in seen` reads "
                "it), or return the values and update the set after the call."
            )
