"""``torch.amp.GradScaler`` inside a jitted step body: the loss scale, the inf check and
the skipped step, all in the graph.

Eager's ``scaler.step(opt)`` reads ``found_inf`` on the host and calls ``opt.step()`` only
if every gradient is finite; a traced step cannot branch on a value. Here the update always
runs and every tensor it writes (the parameters, the optimizer's state) then takes
``torch.where(found_inf, before, after)``: the values eager leaves, bit for bit, with no
host synchronisation. The scale and the growth tracker are inputs of the graph written back
after each call, like a module's tensor attributes (``torch._amp_update_scale_`` updates
them in place); ``scale()``, ``unscale_()`` and ``update()`` are torch's own, traced.

Example (the whole loop is in docs/jit.md, "Mixed precision"):
    >>> import torch
    >>> scaler = torch.amp.GradScaler("cpu")
    >>> prepare_grad_scaler(scaler, torch.device("cpu"))  # state the graph reads and writes
    ['_scale', '_growth_tracker']
    >>> scaler.get_scale()
    65536.0
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from .held_objects import held_values
from .python_location import Root
from .python_reach import is_plain_object

__all__ = [
    "attach_grad_scalers",
    "find_grad_scalers",
    "hold_grad_scaler",
    "prepare_grad_scaler",
    "scalers_step_in_graph",
]

_TORCH_MAYBE_OPT_STEP = torch.amp.GradScaler._maybe_opt_step


def find_grad_scalers(roots: list[Root]) -> list[torch.amp.GradScaler]:
    """The enabled GradScalers the body holds: in its closure or globals, or as an attribute
    of a plain object it reaches (a trainer's ``self.scaler``) or of a library's object it
    holds (timm's ``NativeScaler`` keeps one as ``_scaler``)."""
    values = held_values(roots)
    values += [
        inner
        for value in list(values)
        if library_object(value)
        for inner in vars(value).values()
        if isinstance(inner, torch.amp.GradScaler)
    ]
    found: dict[int, torch.amp.GradScaler] = {}
    for value in values:
        if isinstance(value, torch.amp.GradScaler) and value.is_enabled():
            found.setdefault(id(value), value)
    return list(found.values())


def library_object(value: Any) -> bool:
    """An object of a library (not a tensor, module, optimizer or container) with
    attributes: ``vars()`` of it may hold a GradScaler."""
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return False
    if inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value):
        return False
    return hasattr(value, "__dict__") and not is_plain_object(value)


def prepare_grad_scaler(scaler: torch.amp.GradScaler, device: torch.device) -> list[str]:
    """Make the scaler's scale and growth tracker now (eager makes them at the first
    ``scale()``, with the same values), so that they are state the graph reads and writes;
    returns their attribute names."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    return ["_scale", "_growth_tracker"]


def attach_grad_scalers(capture: Any, roots: list[Root]) -> list[torch.amp.GradScaler]:
    """The GradScalers the body holds, their scale and growth tracker made and added to
    ``capture``'s tensor attributes (read as inputs, written back after each call)."""
    if not capture.params:
        return []
    scalers = find_grad_scalers(roots)
    device = next(iter(capture.params.values())).device
    for i, scaler in enumerate(scalers):
        for attr in prepare_grad_scaler(scaler, device):
            capture.attributes.append((f"grad_scaler{i}.{attr}", scaler, attr))
    return scalers


def hold_grad_scaler(body: Any, name: str, scaler: torch.amp.GradScaler) -> None:
    """Make ``scaler`` one the jitted ``body`` (a :class:`~functacc.core.body.StepBody`)
    holds, as if its code read it by ``name``: for a body functacc writes itself
    (``compile_step``'s), whose closure functacc's own code does not scan."""
    root = Root(name, lambda: scaler, None)
    body.python.roots.append(root)
    body.scalers.extend(attach_grad_scalers(body.capture, [root]))


@contextlib.contextmanager
def scalers_step_in_graph() -> Iterator[None]:
    """While the body is traced: ``GradScaler.step`` steps unless a gradient was not
    finite, as a selection in the graph instead of a branch on the host."""
    original = torch.amp.GradScaler._maybe_opt_step
    torch.amp.GradScaler._maybe_opt_step = _maybe_opt_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.amp.GradScaler._maybe_opt_step = original  # type: ignore[method-assign]


def _maybe_opt_step(
    self: torch.amp.GradScaler, optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any
) -> Any:
    traced = getattr(optimizer.step, "__self__", None)
    if not hasattr(traced, "unless"):
        # Not an optimizer of the jitted step: torch's own (its branch is a clear error).
        return _TORCH_MAYBE_OPT_STEP(self, optimizer, optimizer_state, *args, **kwargs)
    infs = list(optimizer_state["found_inf_per_device"].values())
    # 0-dim sums added, not a stack: scalar arithmetic the update's compile computes before
    # the update (backends/split.py), which then reads one flag instead of a stack.
    found = infs[0].sum()
    for v in infs[1:]:
        found = found + v.to(found.device).sum()
    skip = found > 0
    with traced.unless(skip):
        return optimizer.step(*args, **kwargs)
