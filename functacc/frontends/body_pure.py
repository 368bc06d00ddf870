"""The pure form of a ``compile_step``: ``init_state()`` and ``apply()``.

That step updates the model and the optimizer in place, as the eager step it compiles.
``apply(state, ...)`` runs it on a :class:`TrainState` instead: it saves what the model,
the optimizer and the loss scaler hold, copies ``state`` in, takes the step, copies the
new state out and puts back what was saved, into the same tensors (so the next stateful
call finds everything as it left it). It mutates nothing, not even ``state``; the copies
cost three passes over the state, which the stateful ``step(inputs, targets)`` does not.

The optimizer state of a ``TrainState`` is the pure state of :mod:`functacc.optim` for
``torch.optim.SGD``, ``Adam`` and ``AdamW`` (their functional twins' state), the
transformation's own for :func:`functacc.optim.as_optimizer`, and torch's own
entries by parameter name for every other optimizer, made ahead as its first ``step()``
would make them (:mod:`functacc.core.own_step_state`).

Example:
    >>> import torch, functacc
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
    >>> state = step.init_state()
    >>> new, loss = step.apply(state, torch.randn(8, 4), torch.randn(8, 2))
    >>> sorted(new.opt_state["weight"]), int(new.count), step.count
    (['square_avg', 'step'], 1, 0)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..core.own_step_state import _NotAhead, initial_state
from ..optim import TransformOptimizer
from ..optim._torch import SUPPORTED, TorchOptimizerLink
from .step_fn import TrainState

__all__ = ["PureForm"]


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


class PureForm:
    """Reads the state of ``model``, ``opt`` and ``scaler`` as a :class:`TrainState`,
    writes one in, and saves and restores what they held."""

    def __init__(
        self, model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ):
        self.model, self.opt, self.scaler = model, opt, scaler
        self.params = dict(model.named_parameters())
        self.names = {id(p): n for n, p in self.params.items()}
        self.link = TorchOptimizerLink(opt, self.names) if type(opt) in SUPPORTED else None

    def _opt_params(self) -> dict[str, Tensor]:
        return {self.names[id(p)]: p for g in self.opt.param_groups for p in g["params"]}

    # -- the state as a TrainState ---------------------------------------------------
    def read(self, count: int, *, copy: bool) -> TrainState:
        """The current state; with ``copy=False`` its tensors are the live ones (the
        optimizer's state made ahead where it has none yet, as new tensors)."""
        take = _copy if copy else (lambda v: v)
        params = {n: take(p) for n, p in self.params.items()}
        buffers = {n: take(b) for n, b in self.model.named_buffers()}
        if self.link is not None:
            opt_state: Any = self.link.read_state(self.params, copy=copy)
        elif isinstance(self.opt, TransformOptimizer):
            opt_state = pytree.tree_map(take, self.opt.transform_state())
        else:
            named = self._opt_params()
            try:
                ahead = initial_state(self.opt, named)
            except _NotAhead:  # the first step makes it: the state starts empty
                ahead = {}
            opt_state = {
                n: {k: take(v) for k, v in (self.opt.state.get(p) or ahead.get(n, {})).items()}
                for n, p in named.items()
            }
        extra = None
        if self.scaler is not None:
            extra = {"loss_scale": {k: take(v) for k, v in self._scaler_tensors().items()}}
        device = next(iter(params.values())).device if params else torch.device("cpu")
        return TrainState(params, buffers, opt_state, torch.tensor(count, device=device), extra)

    def write(self, state: TrainState) -> None:
        """Copy ``state`` into the model, the optimizer and the scaler (nothing of it is
        kept: the tensors written into are theirs)."""
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                if n in state.buffers:  # one added after building: the step's error says so
                    b.copy_(state.buffers[n])
            for n, p in self.params.items():
                p.copy_(state.params[n])
            for key, t in self._scaler_tensors().items():
                t.copy_((state.extra or {})["loss_scale"][key])
        # A new state dict, as load_state_dict() makes: both pipelines take its tensors as
        # the live state at the next call (restore() puts the old one back the same way).
        self.opt.state = defaultdict(dict)
        if self.link is not None:
            # The hyperparameters stay the optimizer's current ones, as in the stateful form.
            self.link.install(_copy_tree(state.opt_state), _started(state.opt_state))
            return
        if isinstance(self.opt, TransformOptimizer):
            self.opt.load_transform_state(_copy_tree(state.opt_state))
            return
        named = self._opt_params()
        for n, entries in state.opt_state.items():
            if entries:
                self.opt.state[named[n]] = {k: _copy(v) for k, v in entries.items()}

    def _scaler_tensors(self) -> dict[str, Tensor]:
        if self.scaler is None or self.scaler._scale is None:
            return {}
        return {"scale": self.scaler._scale, "growth_tracker": self.scaler._growth_tracker}

    # -- save and restore ------------------------------------------------------------
    def save(self) -> Any:
        """What :meth:`restore` puts back: every tensor's value and the optimizer's
        entries, param groups included (a step may write into them)."""
        tensors = [*self.params.values(), *self.model.buffers(), *self._scaler_tensors().values()]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        for entries in groups:
            tensors += [v for v in entries.values() if isinstance(v, Tensor)]
        return tensors, [t.detach().clone() for t in tensors], self.opt.state, groups

    def restore(self, saved: Any) -> None:
        tensors, values, state, groups = saved
        with torch.no_grad():
            for t, v in zip(tensors, values, strict=True):
                t.copy_(v)
        self.opt.state = state  # untouched: the step wrote into the state dict write() made
        for group, values_of_group in zip(self.opt.param_groups, groups, strict=True):
            group.update(values_of_group)


def _copy_tree(opt_state: Any) -> Any:
    return pytree.tree_map(_copy, opt_state)


def _started(opt_state: tuple) -> set[str]:
    """The parameters whose pure state says torch would hold state for them (a first step
    with a gradient has run): SGD's momentum ``initialized``, Adam's ``step`` above 0."""
    names = set()
    for group in opt_state:
        flags = getattr(group, "initialized", None)
        if flags is None:
            flags = group.step
        names |= {n for n, f in flags.items() if bool(f)}
    return names
