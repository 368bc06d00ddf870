"""Learning-rate schedulers stepped inside a jitted step: noted while tracing, run for real.

A scheduler's step is Python over Python numbers (``last_epoch``, a cosine of it) that
writes the optimizer's ``param_groups``. While the body is traced, its ``step()`` (torch's
``LRScheduler``s; timm's ``Scheduler``s, also ``step_update()``) is noted as a
:class:`SchedulerEvent` instead of run, with templates of its arguments (a metric the step
computed: ``metric=losses_m.avg``), and run for real before the graph (where the body steps
it before its optimizer) or after it, on every call, as eager runs it. A learning rate read
after such a step is a :class:`LastLR`: known once the step has run, so it can be returned,
stored or formatted, not computed with.

Example:
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> last_lrs(torch.optim.lr_scheduler.StepLR(opt, 1))
    [0.1]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TraceError

__all__ = ["LastLR", "SchedulerEvent", "last_lrs", "patch_schedulers", "scheduler_classes"]

Template = tuple


@dataclass
class SchedulerEvent:
    """``scheduler.step(*args)`` (or ``method``: timm's ``step_update``) in the body, after
    ``position`` steps of its optimizer."""

    scheduler: Any
    args: list[Template]
    kwargs: dict[str, Template]
    position: int
    phase: str = ""  # "before" or "after" the graph, once the whole body is seen
    method: str = "step"

    def run(self, args: list, kwargs: dict) -> list[float]:
        """Step the scheduler for real; the rates it set."""
        getattr(self.scheduler, self.method)(*args, **kwargs)
        return last_lrs(self.scheduler)


class LastLR:
    """``scheduler.get_last_lr()[index]`` (or its optimizer's ``param_groups[index]["lr"]``)
    as the body read it, after ``count`` of the scheduler's steps in this call: known only
    once the steps are replayed, so it can be returned, stored or formatted into text, not
    computed with."""

    def __init__(self, scheduler: Any, count: int, index: int):
        self.scheduler, self.count, self.index = scheduler, count, index

    def __repr__(self) -> str:
        return f"<learning rate {self.index} of {type(self.scheduler).__name__}, after the step>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LastLR) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (id(self.scheduler), self.count, self.index)

    def __format__(self, spec: str) -> str:
        """A token that :func:`~functacc.core.python_output.fill` replaces by the rate
        once the scheduler's steps are replayed (``f"lr {lr:.2e}"``)."""
        if self.count == 0:
            return _refuse(self)
        return f"\x00functacclr{id(self.scheduler)}.{self.count}.{self.index}:{spec}\x00"


def _refuse(self: LastLR, *args: Any) -> Any:
    if self.count == 0:  # not stepped in this call (yet): the rate kept on the scheduler
        raise TraceError(
            f"the step computes with (or formats) {type(self.scheduler).__name__}"
            ".get_last_lr(), a learning rate kept on the scheduler, outside the graph: the "
            "step may return it or store it (a list, an attribute), not compute with it. "
            "Fix: read optimizer.param_groups[i]['lr'] (fed to the graph on every call: "
            "f\"lr {opt.param_groups[0]['lr']:.2e}\"), or scheduler.get_last_lr() outside "
            "the step."
        )
    raise TraceError(
        f"the step computes with the learning rate {type(self.scheduler).__name__} sets "
        "(get_last_lr(), or the optimizer's param_groups[i]['lr'] read after the scheduler's "
        "step) after stepping it inside the step. functacc.jit steps the scheduler for real "
        "after the graph (as eager steps it), so its new learning rate is known only then: "
        "the step may return it, store it (a list, an attribute) or format it into text "
        "(an f-string, format()), not compute with it. Fix: return it and compute with it "
        "after the call."
    )


for _name in [
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__pow__",
    "__rpow__",
    "__neg__",
    "__float__",
    "__int__",
    "__bool__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__round__",
    "__abs__",
]:
    setattr(LastLR, _name, _refuse)


def scheduler_classes() -> list[type]:
    """The scheduler classes whose steps are noted: torch's, and timm's where it is loaded."""
    roots = [torch.optim.lr_scheduler.LRScheduler]
    timm = sys.modules.get("timm.scheduler.scheduler")
    if timm is not None:
        roots.append(timm.Scheduler)
    return [cls for root in roots for cls in _subclasses(root)]


def last_lrs(scheduler: Any) -> list[float]:
    """The rates ``scheduler`` has set, one per param group (timm's keep none of their own:
    they write ``param_group_field`` of each group)."""
    if hasattr(scheduler, "get_last_lr"):
        return list(scheduler.get_last_lr())
    field = getattr(scheduler, "param_group_field", "lr")
    return [group[field] for group in scheduler.optimizer.param_groups]


def sets_lr(scheduler: Any) -> bool:
    """Whether the scheduler sets the learning rate (a timm scheduler may set another field)."""
    return getattr(scheduler, "param_group_field", "lr") == "lr"


def patch_schedulers(
    recorder: Any, patch: Callable[[Any, str, Any], None], patches: list[tuple[Any, str, Any]]
) -> None:
    """Replace, with ``patch``, each scheduler class's steps by stand-ins that note a
    :class:`SchedulerEvent` on ``recorder``, its ``get_last_lr`` by one that gives
    :class:`LastLR`s, and its ``state_dict``/``load_state_dict`` by a refusal."""
    from .python_effects import ABSENT, checkpoint_refused

    def stand_in(method: str) -> Callable[..., None]:
        def noted(scheduler: Any, *args: Any, **kwargs: Any) -> None:
            optimizer = getattr(scheduler, "optimizer", None)
            where = f"{type(scheduler).__name__}.{method}()'s arguments"
            recorder.schedulers.append(
                SchedulerEvent(
                    scheduler,
                    [recorder.template(a, where) for a in args],
                    {k: recorder.template(v, where) for k, v in kwargs.items()},
                    recorder.steps_taken.get(id(optimizer), 0),
                    method=method,
                )
            )

        return noted

    def last_lr_stand_in(scheduler: Any) -> list[LastLR]:
        count = sum(e.scheduler is scheduler for e in recorder.schedulers)
        return [LastLR(scheduler, count, i) for i in range(len(scheduler.get_last_lr_real()))]

    for cls in scheduler_classes():
        patch(cls, "__init__", _made_in_step)  # (where the class has its own)
        for name in ("state_dict", "load_state_dict"):
            patch(cls, name, checkpoint_refused("the scheduler's"))
        for method in ("step", "step_update"):
            patch(cls, method, stand_in(method))
        if "get_last_lr" in vars(cls):
            real = vars(cls)["get_last_lr"]
            patch(cls, "get_last_lr", last_lr_stand_in)
            cls.get_last_lr_real = real
            patches.append((cls, "get_last_lr_real", ABSENT))


def _made_in_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from .failure_sites import call_site

    raise TraceError(
        f"the step creates a learning-rate scheduler ({type(scheduler).__name__}(...) at "
        f"{call_site()}) while functacc.jit traces it: the scheduler would be made once, at "
        "the trace (its constructor sets the optimizer's rates then), where eager makes it "
        "in the call that runs that line. Fix: create it before the first call (where the "
        "optimizer is made, also one made lazily, `if self.sched is None: ...`), and step "
        "it in the step as you do."
    )


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out
