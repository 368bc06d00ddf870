"""An optimizer's state made before its first traced ``step()``, as that step makes it.

Torch's optimizers make their state in ``_init_group``, which runs at the start of
``step()``: it is run on its own and stopped there. Others (third parties, a class of your
own) run one step on a copy of the optimizer and of the parameters; the state is kept only
where a second dry run from it gives what the first did, else it cannot be made ahead
(``_NotAhead``) and the first call's graph creates it.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    >>> state = initial_state(opt, dict(model.named_parameters()))
    >>> sorted(state["weight"]), len(opt.state)  # created as step() would, not shown yet
    (['square_avg', 'step'], 0)
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["initial_state", "state_holder"]


class _InitDone(Exception):  # a signal: _init_group has run
    pass


def initial_state(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> dict:
    """The state ``optimizer``'s first ``step()`` would create for each of ``params`` that
    has none yet (by name), without changing the optimizer, its parameters or their grads.

    torch's optimizers create it in ``_init_group``: that runs, and the step stops right
    after it. Others are stepped once on a deep copy, whose state dicts note each entry as
    it is first assigned; a second copy stepped from those entries must end bit for bit
    where the first did, else the state cannot be made ahead (``_NotAhead``)."""
    holder = state_holder(optimizer)
    missing = {n: p for n, p in params.items() if not holder.state.get(p)}
    if not missing:
        return {}
    if _made_in_init_group(holder):  # a wrapper's base (Lookahead's AdamW) too
        return _init_group_state(holder, missing)
    if holder is not optimizer:  # a dry run would step the optimizer it wraps, for real
        raise _NotAhead(type(optimizer).__name__)
    return _first_assignments(optimizer, missing)


def state_holder(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``state`` holds ``optimizer``'s: one it wraps and shares its
    ``param_groups`` list with (timm's ``Lookahead``: ``self.param_groups =
    base_optimizer.param_groups``; its step runs the base's, which keeps the state, and
    adds its slow weights there), else ``optimizer`` itself."""
    for value in vars(optimizer).values():
        inner = isinstance(value, torch.optim.Optimizer) and value is not optimizer
        if inner and value.param_groups is optimizer.param_groups:
            return state_holder(value)
    return optimizer


def _made_in_init_group(optimizer: torch.optim.Optimizer) -> bool:
    cls = type(optimizer)
    return cls.__module__.startswith("torch.optim") and hasattr(cls, "_init_group")


def _init_group_state(optimizer: torch.optim.Optimizer, missing: dict[str, Tensor]) -> dict:
    by_id = {id(p): n for n, p in missing.items()}
    saved_groups, saved_grads = optimizer.param_groups, {n: p.grad for n, p in missing.items()}
    real_init = type(optimizer)._init_group

    def init_then_stop(self: Any, *args: Any, **kwargs: Any) -> Any:
        real_init(self, *args, **kwargs)
        raise _InitDone

    made: dict[str, dict] = {}
    try:
        optimizer._init_group = init_then_stop.__get__(optimizer)  # type: ignore[method-assign]
        for p in missing.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # torch creates state only where there is one
        for group in saved_groups:
            params = [p for p in group["params"] if id(p) in by_id]
            if not params:
                continue
            optimizer.param_groups = [{**group, "params": params}]
            try:
                with torch.no_grad():
                    type(optimizer).step(optimizer)
            except _InitDone:
                pass
            else:  # pragma: no cover - a torch optimizer that skips _init_group
                raise RuntimeError(f"{type(optimizer).__name__}.step() did not call _init_group")
            for p in params:
                made[by_id[id(p)]] = optimizer.state.pop(p, {})
    finally:
        optimizer.param_groups = saved_groups
        vars(optimizer).pop("_init_group", None)
        for n, p in missing.items():
            p.grad = saved_grads[n]
    return made


class _FirstAssignments(dict):
    """A parameter's state dict that keeps a copy of each entry as first assigned."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[Any, Any] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self.first:
            self.first[key] = value.clone() if isinstance(value, Tensor) else copy.copy(value)
        super().__setitem__(key, value)


def _first_assignments(optimizer: torch.optim.Optimizer, missing: dict[str, Tensor]) -> dict:
    names = {id(p): n for n, p in missing.items()}
    generator = torch.Generator().manual_seed(0)
    grads = {
        n: torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device)
        for n, p in missing.items()
    }

    def stepped_copy(start: dict[str, dict] | None) -> tuple[dict, list]:
        clone, copies = _clone(optimizer)
        recorded: dict[str, _FirstAssignments] = {}
        state: Any = defaultdict(_FirstAssignments)
        for q, p in copies.items():
            if q in names:
                n = names[q]
                p.grad = grads[n].clone()
                if start is not None:
                    state[p] = {k: _copy(v) for k, v in start[n].items()}
                recorded[n] = state[p]
            elif p in clone.state:
                state[p] = clone.state[p]
        clone.state = state
        try:
            with torch.no_grad():
                type(clone).step(clone)
        except Exception as e:  # its step needs what is set later (schedulefree: .train())
            raise _NotAhead(type(optimizer).__name__) from e
        params = [p.detach().clone() for g in clone.param_groups for p in g["params"]]
        return recorded, [params, *[dict(r) for r in recorded.values()]]

    recorded, after = stepped_copy(None)
    made = {n: dict(r.first) for n, r in recorded.items()}
    # An entry made a number and left a tensor (Hugging Face's Adafactor: RMS = 0, then
    # RMS = _rms(p)): the state's layout after a step is not the one made first.
    if any(
        isinstance(v, torch.Tensor) != isinstance(r.first[k], torch.Tensor)
        for r in recorded.values()
        for k, v in r.items()
    ):
        raise _NotAhead(type(optimizer).__name__)
    _, again = stepped_copy(made)
    if not _same(after, again):
        raise _NotAhead(type(optimizer).__name__)
    return made


class _NotAhead(Exception):  # a signal: the state cannot be made ahead
    """The optimizer's first step treats state it creates differently from given state."""


def _clone(optimizer: torch.optim.Optimizer) -> tuple[Any, dict[int, Tensor]]:
    """A copy of ``optimizer`` over copies of its parameters and state (its own attributes
    kept: ``copy.deepcopy`` keeps only what ``Optimizer.__getstate__`` names); returns it
    and the copied parameters by ``id`` of the original."""
    clone = object.__new__(type(optimizer))
    vars(clone).update(vars(optimizer))
    copies = {
        id(p): p.detach().clone().requires_grad_(p.requires_grad)
        for g in optimizer.param_groups
        for p in g["params"]
    }
    # Entries deep-copied: a list kept in a group (timm 1.0.20's AdaBelief caches step
    # sizes in group["buffer"]) would otherwise take this copy's step.
    clone.param_groups = [
        {**_entries_copy(g), "params": [copies[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    clone.defaults = _entries_copy(optimizer.defaults)
    clone.state = defaultdict(dict)
    for p, entries in optimizer.state.items():
        if id(p) in copies:
            clone.state[copies[id(p)]] = {k: _copy(v) for k, v in entries.items()}
    return clone, copies


def _entries_copy(group: dict) -> dict:
    return {k: v if k == "params" else copy.deepcopy(v) for k, v in group.items()}


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else copy.copy(value)


def _same(a: Any, b: Any) -> bool:
    flat_a, spec_a = pytree.tree_flatten(a)
    flat_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, Tensor):
            if not (isinstance(y, Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
