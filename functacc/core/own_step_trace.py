"""An optimizer traced whole while the step body is traced (:mod:`.own_step` links it
across calls): its real ``step()`` runs over the traced parameters, the state's
placeholders and the fed hyperparameters. Python numbers the step computes with stay
symbolic (:class:`~.scalar_reads.ScalarReads`, :func:`symbolic_builtins`: ``max``, ``min``
and ``math`` on symbols), so a branch on one is a guard; under a GradScaler
:meth:`OwnStepTrace.unless` selects the state a skipped step leaves.

Example:
    >>> from functacc.core.own_step_trace import OwnStepTrace
    >>> OwnStepTrace.__name__
    'OwnStepTrace'
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..errors import argument_error
from ..optim import TransformOptimizer
from .own_step import OwnStepLink, _fed
from .python_effects import checkpoint_refused
from .python_location import Location
from .python_numbers import symbolic_builtins
from .scalar_reads import ScalarReads

__all__ = ["OwnStepTrace", "refuse_state_dicts"]


# -- while the body is traced ---------------------------------------------------------------
class OwnStepTrace:
    """The optimizer while its step body is traced: its real ``step()`` runs over the traced
    parameters, state and fed hyperparameters."""

    def __init__(
        self, link: OwnStepLink, placeholders: list[Tensor], leaf_of: Callable, python: Any
    ):
        self.link = link
        self.leaf_of = leaf_of
        self.python = python
        self.stepped: set[str] = set()
        paths, _ = link.leaves()
        by_path = dict(zip(paths, placeholders, strict=True))
        self.state = {
            n: {
                k: by_path[f".state[{n!r}][{k!r}]"] if isinstance(v, Tensor) else v
                for k, v in entries.items()
            }
            for n, entries in link.store.items()
        }
        self._hyper = [
            {k: ("tensor", by_path[f".param_groups[{i}][{k!r}]"]) for k in entries}
            for i, entries in enumerate(link.tensors)
        ]
        self.placeholders = dict(zip(paths, placeholders, strict=True))

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Per param group, the graph's inputs for its entries (for the recording groups)."""
        return self._hyper

    def __enter__(self) -> OwnStepTrace:
        opt = self.link.optimizer
        self._saved_params = [g["params"] for g in opt.param_groups]
        holder = self.link.holder  # a wrapper's (Lookahead's) base optimizer keeps the state
        self._saved_state = (opt.state, holder.state)
        self._saved_step = vars(opt).get("step")  # an lr_scheduler's wrapper, kept
        for group, names in zip(opt.param_groups, self.link.groups, strict=True):
            group["params"] = [self.leaf_of(n) for n in names]
        state: Any = defaultdict(dict)
        for n in self.link.params:
            state[self.leaf_of(n)] = self.state[n]
        opt.state = holder.state = state
        undo = [refuse_state_dicts(o) for o in {id(opt): opt, id(holder): holder}.values()]
        self._undo = lambda: [u() for u in reversed(undo)]
        self._numbers = {
            n: {k: v for k, v in d.items() if not isinstance(v, Tensor)}
            for n, d in self.state.items()
        }
        for n, numbers in self._numbers.items():
            for k, v in numbers.items():
                loc = Location(self.link.roots[n], (("item", k),))
                fed = self.python.symbolic_inputs.get(loc) if self.python is not None else None
                if fed is not None:
                    self.python.symbols[fed.node.expr] = loc
                    self.state[n][k] = fed
                elif self.python is not None:
                    self.python.guard(loc, v)
        opt.step = self.step  # an instance attribute shadows the class's step
        self._saved_holder_step = vars(holder).get("step")
        if holder is not opt:  # SAM's second_step() steps its base itself: noted too
            holder.step = self._noting(holder.step)
        return self

    def _noting(self, step: Callable) -> Callable:
        def noted(*args: Any, **kwargs: Any) -> Any:
            self._note_stepped()
            return step(*args, **kwargs)

        return noted

    def _note_stepped(self) -> None:
        """The parameters this step updates: their state shows in ``opt.state`` after it."""
        owners = self.link.owners
        self.stepped |= {
            n
            for n in self.link.params
            if self.leaf_of(n).grad is not None and (owners is None or owners.owns(n))
        }

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # as torch's step(closure) (LBFGS is refused): once, first
            with torch.enable_grad():
                loss = closure()
        opt = self.link.optimizer
        owners = self.link.owners
        self._note_stepped()
        sources, fed = {}, {}
        for (n, key), scalar in self.link.scalars.items():
            placeholder = self.placeholders[f".state[{n!r}][{key!r}]"]
            sources[id(placeholder)] = scalar
            value = self.python.symbolic_inputs.get(scalar) if self.python is not None else None
            if value is not None:
                fed[id(placeholder)] = value
                self.python.symbols[value.node.expr] = scalar
        symbols = self.python.symbols if self.python is not None else {}
        owners = self.link.owners
        # ZeRO-1: this rank steps the parameters it owns (as_optimizer's own() narrows itself)
        narrow = owners is not None and not isinstance(opt, TransformOptimizer)
        if narrow:
            for group, names in zip(opt.param_groups, self.link.groups, strict=True):
                group["params"] = [self.leaf_of(n) for n in names if owners.owns(n)]
        nested = _nested_entries(opt)
        try:
            with torch.no_grad(), ScalarReads(sources, fed, symbols), symbolic_builtins(opt):
                result = type(opt).step(opt)
            _check_nested_unchanged(opt, nested, self.link.label)
        finally:
            if narrow:
                for group, names in zip(opt.param_groups, self.link.groups, strict=True):
                    group["params"] = [self.leaf_of(n) for n in names]
        if owners is not None:
            with torch.no_grad():
                owners.gather({n: self.leaf_of(n) for n in self.link.params})
        if self.python is not None:
            self.python.stepped(opt)
        return loss if closure is not None else result

    @contextlib.contextmanager
    def unless(self, skip: Tensor) -> Iterator[None]:
        """A ``step()`` inside leaves the parameters and state as they were where ``skip``
        (a GradScaler's found inf) is true: each tensor takes ``where(skip, before,
        after)``, written in place or assigned as the step left it."""
        params = [self.leaf_of(n) for n in self.link.params]
        params += [t for group in self._hyper for _, t in group.values()]  # written in place
        entries = {n: dict(d) for n, d in self.state.items()}
        before = [p.detach().clone() for p in params]
        old = {
            (n, k): v.detach().clone() if isinstance(v, Tensor) else v
            for n, d in entries.items()
            for k, v in d.items()
        }
        yield
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                p.copy_(torch.where(skip, b, p))
            for n, d in self.state.items():
                for k, v in d.items():
                    if (n, k) not in old:
                        raise argument_error(
                            f"{self.link.label}.step() under a GradScaler made its state "
                            f"{k!r} in the step; a skipped step would not have. Take one "
                            "step before jitting, or use SGD, Adam or AdamW."
                        )
                    if not isinstance(v, Tensor):
                        if v is not old[(n, k)]:
                            raise argument_error(
                                f"{self.link.label}.step() under a GradScaler changed the "
                                f"Python number {k!r} of its state, which a skipped step "
                                "must leave as it was; functacc.jit selects tensors only."
                            )
                        continue
                    if v is entries[n][k]:  # written in place
                        v.copy_(torch.where(skip, old[(n, k)], v))
                    else:
                        d[k] = torch.where(skip, old[(n, k)], v)

    def __exit__(self, *exc: object) -> None:
        opt = self.link.optimizer
        for group, params in zip(opt.param_groups, self._saved_params, strict=True):
            group["params"] = params
        opt.state, self.link.holder.state = self._saved_state
        self._undo()
        steps = {id(opt): (opt, self._saved_step)}
        steps.setdefault(id(self.link.holder), (self.link.holder, self._saved_holder_step))
        for obj, saved in steps.values():
            if saved is None:
                vars(obj).pop("step", None)
            else:
                obj.step = saved

    def write_back(self) -> None:
        """At the end of the traced body: new state values go into the state's inputs (the
        graph's final writes); numbers the step wrote are replayed after each call."""
        promote = []
        for n, entries in self.state.items():
            root = self.link.roots[n]
            for key, value in list(entries.items()):
                path = f".state[{n!r}][{key!r}]"
                placeholder = self.placeholders.get(path)
                if placeholder is not None:
                    if value is not placeholder:
                        _write(placeholder, value, f"{self.link.label}{path}")
                    continue
                loc = Location(root, (("item", key),))
                old = self._numbers.get(n, {}).get(key, _ABSENT)
                if value is old:
                    continue
                if self.python is None:
                    raise argument_error(f"{self.link.label}{path} changed outside a traced body")
                if _fed(old) and loc not in self.python.symbolic_inputs:
                    promote.append(loc)
                if old is _ABSENT:
                    self.link.created = True
                self.python.effects.append(
                    ("assign", loc, self.python.template(value, f"{self.link.label}{path}"))
                )
        if promote:
            from .python_trace import Retry

            raise Retry(promote)


_ABSENT = object()
_CONTAINERS = (list, dict)


def _nested_entries(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], Any]:
    """Copies of the mutable containers among ``param_groups``' entries (a list of lists,
    a dict), to see whether ``step()`` writes inside them."""
    return {
        (i, k): copy.deepcopy(v)
        for i, group in enumerate(optimizer.param_groups)
        for k, v in group.items()
        if k != "params" and type(v) in _CONTAINERS and not _holds(v, (Tensor,))
    }


def _check_nested_unchanged(
    optimizer: torch.optim.Optimizer, saved: dict[tuple[int, str], Any], label: str
) -> None:
    """A traced ``step()`` that wrote inside a container of ``param_groups`` (timm 1.0.20's
    AdaBelief and RAdam cache step sizes in ``group['buffer']``, a list of lists) would write
    there once, at the trace, and leave the graph's symbols there: restore the containers
    and refuse, naming the entry (the body's own Python state is followed; an optimizer's
    nested containers are not)."""
    for (i, k), before in saved.items():
        now = optimizer.param_groups[i].get(k)
        if _holds(now, (torch.SymInt, torch.SymFloat, torch.SymBool)) or now != before:
            if type(now) is list:
                now[:] = before
            elif type(now) is dict:
                now.clear()
                now.update(before)
            raise argument_error(
                f"{label}.step() writes inside {label}.param_groups[{i}][{k!r}] (a "
                f"{type(now).__name__} it keeps between steps), which a traced step would "
                "write once, when traced, not on every call. functacc.jit follows numbers "
                "kept in param_groups' entries and in the state, not inside containers. Fix: "
                "an optimizer that keeps such numbers in its state or as entries (for timm's "
                "AdaBelief or RAdam: timm 1.0.31 or later, or rectify=False), or call its "
                "step() after the jitted function (still listed in optimizers=).",
                TypeError,
            )


def _holds(value: Any, kinds: tuple[type, ...]) -> bool:
    return any(isinstance(v, kinds) for v in torch.utils._pytree.tree_leaves(value))


def _write(placeholder: Tensor, value: Any, where: str) -> None:
    if (
        not isinstance(value, Tensor)
        or value.shape != placeholder.shape
        or value.dtype != placeholder.dtype
    ):
        got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, Tensor) else repr(value)
        raise argument_error(
            f"{where} was replaced by {got} in the optimizer's step, where it held "
            f"{tuple(placeholder.shape)} {placeholder.dtype}; functacc writes the state in "
            "place, which needs the same shape and dtype."
        )
    with torch.no_grad():
        placeholder.copy_(value)


def refuse_state_dicts(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """While the step is traced: ``opt.state_dict()`` and ``load_state_dict`` are a clear
    error (:func:`~.python_effects.checkpoint_refused`). Returns the undo."""
    saved = {n: vars(opt)[n] for n in ("state_dict", "load_state_dict") if n in vars(opt)}

    def undo() -> None:
        for name in ("state_dict", "load_state_dict"):
            vars(opt).pop(name, None)
        vars(opt).update(saved)

    refused = checkpoint_refused(type(opt).__name__)
    opt.state_dict = opt.load_state_dict = refused  # instance attributes shadow the class's
    return undo
