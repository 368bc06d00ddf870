"""The live training state of ``compile_step``, kept in step with the ``torch.optim`` optimizer.

The stateful step updates one :class:`TrainState` in place: the model's own parameters
(or this rank's shards of them), its buffers, the optimizer state, the step count. With a
``torch.optim`` optimizer, that optimizer stays the user's: ``opt.state`` holds the live
state tensors (from the first step on, as torch creates state at the first step),
``opt.load_state_dict()`` and edits of ``param_groups`` between calls are followed, and a
checkpoint written into the live state shows in the optimizer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..optim import GradientTransformation
from ..optim._torch import TorchOptimizerLink
from ..transforms.precision import Precision
from .step_fn import StepFunction, TrainState

__all__ = ["LiveState"]


class LiveState:
    """The state the stateful step reads and writes, and its link to ``opt``.

    ``link`` mirrors a ``torch.optim`` optimizer (``None`` for a
    :class:`~functacc.optim.GradientTransformation`); ``strategy`` (data parallel, ZeRO)
    says which part of the state this rank holds.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer | GradientTransformation,
        link: TorchOptimizerLink | None,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        strategy: Any,
        precision: Precision | None,
        device: torch.device,
    ):
        self.link = link
        self.params = params  # the model's own, by name
        self.buffers = buffers
        self.strategy = strategy
        self.precision = precision
        self.device = device
        self.installed = False  # the live optimizer state is in opt.state
        self.hyper_key: tuple = ()  # the optimizer's structure: a change retraces
        self.fn: StepFunction | None = None
        self._opt = opt

    @staticmethod
    def link_for(opt: Any, params: dict[str, Tensor]) -> TorchOptimizerLink | None:
        if isinstance(opt, GradientTransformation):
            return None
        return TorchOptimizerLink(opt, {id(p): n for n, p in params.items()})

    def transform(self) -> GradientTransformation:
        """The functional optimizer the step applies (the torch optimizer's twin)."""
        if self.link is None:
            return self._opt
        groups = self.strategy.optimizer_groups(self.link.groups)
        return self.link.transform(groups)

    def start(self, fn: StepFunction) -> None:
        """The initial state, for the step function ``fn`` (which holds the transform)."""
        self.fn = fn
        self.set(self._initial())
        if self.link is not None and hasattr(self.strategy, "link_optimizer"):
            # ZeRO: opt.state_dict() gathers the sharded state, load_state_dict() shards it.
            ref = weakref.ref(self)
            self.strategy.link_optimizer(
                self.link,
                lambda: ref().state if ref() is not None else None,
                lambda: ref().fn.transform,
            )

    def set(self, state: TrainState) -> None:
        self.state = state
        self.leaves, self.spec = pytree.tree_flatten(state)

    def _initial(self) -> TrainState:
        strategy, link = self.strategy, self.link
        if link is not None and strategy.named_state:
            params = strategy.live_params(self.params)
            opt_state = link.read_state(self.params, copy=False)
        elif link is not None:
            # Read torch's (full) state before the strategy shards the parameters.
            named = link.read_state(self.params, copy=True)
            params = strategy.live_params(self.params)
            opt_params = strategy.optimizer_params(params)
            opt_state = strategy.shard_optimizer_state(named, self.fn.transform, opt_params)
        else:
            params = strategy.live_params(self.params)
            opt_state = self.fn.transform.init(strategy.optimizer_params(params))
        if link is not None:
            self._torch_state = link.optimizer.state
        # On the parameters' device: a CUDA graph must read and advance it on the GPU.
        count = torch.zeros((), dtype=torch.int64, device=self.device)
        extra = strategy.init_extra(self.params)
        if self.precision is not None and self.precision.loss_scaling:
            extra["loss_scale"] = self.precision.init_state(self.device)
        self.hyper_key = link.structure_key() if link else ()
        return TrainState(params, self.buffers, opt_state, count, extra)

    def refresh(self) -> None:
        """Follow ``opt.load_state_dict`` and hyperparameter edits made between calls."""
        link = self.link
        if link is None:
            return
        if link.optimizer.state is not self._torch_state and self.strategy.named_state:
            # load_state_dict() replaces the state dict: adopt its tensors as the live state.
            self._torch_state = link.optimizer.state
            opt_state = link.read_state(self.params, copy=False)
            self.set(self.state._replace(opt_state=opt_state))
            self.installed = False
        if not link.poll():
            return  # param_groups as at the last call: nothing to re-read
        if not link.same_groups():
            try:
                self._regroup()
            except Exception:
                link.forget_poll()  # the next call checks (and fails) again
                raise
        hyper_key = self.link.structure_key()
        if hyper_key != self.hyper_key:
            self.fn.transform = self.transform()
            self.hyper_key = hyper_key
        self.link.sync_hyperparams(self.state.opt_state)

    def _regroup(self) -> None:
        """``optimizer.add_param_group()`` (or a group's parameters edited) after the step
        was built: as in eager, the new parameters train from this call on. The optimizer
        state of the parameters already trained carries over (it is the torch optimizer's
        own); the new ones start fresh, and the next trace updates every group."""
        optimizer = self.link.optimizer
        if not self.strategy.named_state:
            raise RuntimeError(
                f"optimizer.param_groups changed after the {self.strategy.name} step was "
                "built (optimizer.add_param_group(), or parameters added to or removed from a "
                "group): the step shards each group's parameters when it is built. Build the "
                "step again with compile_step() after changing the optimizer's groups."
            )
        link = self.link_for(optimizer, self.params)
        opt_state = link.read_state(self.params, copy=False)  # checks before any change
        self.link = link
        self.fn.transform = self.transform()
        self.set(self.state._replace(opt_state=opt_state))
        self.installed = False  # the new parameters' state goes into opt.state next step
        self.hyper_key = link.structure_key()  # a new structure: the next trace

    def stepped(self, names_with_grads: frozenset[str]) -> None:
        """After a successful step of the stateful form."""
        if self.link is None:
            return
        # What torch.optim.lr_scheduler checks to know the optimizer stepped (it warns
        # about a skipped first value otherwise).
        self.link.optimizer._opt_called = True
        if not self.installed and self.strategy.named_state:
            # torch creates optimizer state at the first step; so do we, only once the
            # first step has succeeded (a failed first call must leave opt.state empty).
            self.link.install(self.state.opt_state, names_with_grads)
            self.installed = True

    def after_load(self) -> None:
        """After a checkpoint wrote into the live state: the torch optimizer shows it."""
        if self.link is None:
            return
        self.link.write_hyperparams(self.state.opt_state)
        if self.strategy.named_state:
            trainable = {n for n, p in self.params.items() if p.requires_grad}
            self.link.install(self.state.opt_state, trainable)
            self.installed = True

    def load_full_params(self) -> None:
        """The model's parameters were overwritten (load_model): re-shard them into the
        live state where the state holds shards."""
        self.strategy.load_full_params(self.params, self.state.params)
