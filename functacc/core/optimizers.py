"""``opt.step()`` inside a traced step: functacc's pure twin of a ``torch.optim`` optimizer.

Tracing ``torch.optim``'s own ``step()`` bakes Python floats into the graph (the learning
rate, and the step count through ``.item()``) and creates state lazily. Instead, while a
step body is traced, the optimizer's ``step`` runs the pure transformation of
:class:`~functacc.optim._torch.TorchOptimizerLink` (tested bit for bit against
``torch.optim``) on the parameters' current ``.grad``, over state tensors that are inputs
of the graph: hyperparameters included, so a learning-rate schedule never retraces. After
each call the optimizer's ``state`` holds the very tensors the graph updates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..errors import argument_error
from ..optim._torch import TorchOptimizerLink, _check_supported, check_owned_parameters
from ..optim._transform import step_params
from .state_seen import StateSeen
from .traced_state_view import state_view

__all__ = [
    "LinkedOptimizer",
    "TracedOptimizer",
    "link_optimizer",
    "trace_optimizer",
]


def link_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str], label: str) -> Any:
    """The live state of one optimizer of a jitted step: functacc's pure twin for SGD, Adam
    and AdamW (:class:`LinkedOptimizer`), the optimizer's own ``step()`` traced for any
    other (:class:`~functacc.core.own_step.OwnStepLink`)."""
    from ..optim._torch import SUPPORTED
    from .own_step import OwnStepLink, check_traceable

    if type(optimizer) in SUPPORTED:
        return LinkedOptimizer(optimizer, names, label)
    check_traceable(optimizer, names, label)
    return OwnStepLink(optimizer, names, label)


def trace_optimizer(linked: Any, placeholders: list[Tensor], leaf_of: Callable, python: Any) -> Any:
    """The optimizer while its body is traced (see :func:`link_optimizer`)."""
    from .own_step import OwnStepLink
    from .own_step_trace import OwnStepTrace

    if isinstance(linked, OwnStepLink):
        return OwnStepTrace(linked, placeholders, leaf_of, python)
    return TracedOptimizer(linked, placeholders, leaf_of, python)


class LinkedOptimizer:
    """One ``torch.optim`` optimizer of a jitted step and its live pure state.

    ``names`` maps each parameter (by ``id``) to its name among the step's modules;
    ``link_class`` keeps the optimizer and its pure state in sync (a ``functacc.optim``
    transformation's under ZeRO-3: ``parallel/jit_strategy.py``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        names: Mapping[int, str],
        label: str,
        link_class: type = TorchOptimizerLink,
    ):
        if link_class is TorchOptimizerLink:
            _check_supported(optimizer)
        if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
            raise argument_error(
                f"{label} has step hooks (register_step_pre_hook / register_step_post_hook); "
                "a jitted step runs the optimizer's update inside its graph, where those "
                "Python hooks would not run on every call. Remove them (handle.remove())."
            )
        check_owned_parameters(optimizer, names, label)
        self.optimizer = optimizer
        self.label = label
        self.names = names
        self.sharding: Any = None  # ZeRO: functacc.parallel.zero_jit.ShardedOptimizer
        self._link_class = link_class
        self._link_up()

    def _link_up(self) -> None:
        """(Re)build the link: at the start, and after ``param_groups`` changed."""
        self.link = self._link_class(self.optimizer, self.names)
        if self.sharding is not None and hasattr(self.link, "sum_group"):
            # A transformation's global_norm: its squares summed over the shard group.
            self.link.sum_group = self.sharding.sharded.topology.shard_group
        self.transform = self.link.transform()
        self._structure = self.link.structure_key()
        self._torch_state = self.optimizer.state
        self.installed: frozenset[str] = frozenset()
        self._seen = StateSeen(self._torch_state)
        if self.sharding is not None:
            named = self.link.read_state(self.link.params, copy=True)
            self.state = self.sharding.shard_state(named, self.transform, self.link.params)
            # The shards are the state now; state_dict() gathers it whole.
            self.optimizer.state.clear()
            return
        # The optimizer's own tensors where it has state (copy=False): the graph writes
        # into them; fresh zeros for the rest, installed once their parameter steps.
        self.state = self.link.read_state(self.link.params, copy=False)

    def shard(self, sharding: Any) -> None:
        """Keep and update only this rank's shard of the state (ZeRO; ``sharding`` is a
        :class:`~functacc.parallel.zero_jit.ShardedOptimizer` for this optimizer)."""
        self.sharding = sharding
        self._link_up()
        sharding.show_whole(self, lambda: self.transform)

    @property
    def state(self) -> tuple:
        return self._state

    @state.setter
    def state(self, value: tuple) -> None:
        self._state = value
        self._leaves: tuple[list[str], list[Tensor]] | None = None

    def refresh(self) -> tuple:
        """Follow what changed between calls (``load_state_dict``, hyperparameters, a new
        param group); returns the structure key (a new one: a new graph)."""
        if self.optimizer.state is not self._torch_state:
            if self.sharding is None:
                # load_state_dict() replaces the state dict: its tensors are the live state.
                self._link_up()
            else:
                # Its post-hook (ShardedOptimizer.show_whole) sharded them into the state.
                self._torch_state = self.optimizer.state
        elif self.sharding is None and not self._seen.holds(self._torch_state):
            # Changed in place between calls (clear(), del, an entry replaced): eager's
            # next step() reads what is there now, and so does the graph.
            self._link_up()
        if self.link.poll():
            if not self.link.same_groups():
                if self.sharding is not None:
                    raise argument_error(
                        f"{self.label}'s param_groups changed (add_param_group, or params "
                        "replaced) after functacc.jit sharded its state over the ranks "
                        "(ZeRO). Build the step again with functacc.jit(...)."
                    )
                # add_param_group(): as in eager, the new parameters train from now on; the
                # state of those trained so far carries over (it is torch's own).
                try:
                    check_owned_parameters(self.optimizer, self.names, self.label)
                except ValueError:
                    self.link.forget_poll()  # the same check, and error, at the next call
                    raise
                self._link_up()
                return self._structure
            structure = self.link.structure_key()
            if structure != self._structure:
                self.transform = self.link.transform()
                self._structure = structure
            self.link.sync_hyperparams(self.state)
        return self._structure

    def leaves(self) -> tuple[list[str], list[Tensor]]:
        """The state's tensors and their paths, in a fixed order (kept until the state is
        replaced: the hot path of every call)."""
        if self._leaves is None:
            flat = pytree.tree_flatten_with_path(self.state)[0]
            self._leaves = ([pytree.keystr(p) for p, _ in flat], [t for _, t in flat])
        return self._leaves

    def install(self, names_with_grads: frozenset[str]) -> None:
        """After a call: ``optimizer.state`` holds the state of every parameter stepped
        so far (torch creates it at a parameter's first step)."""
        if not names_with_grads <= self.installed and self.sharding is None:
            self.installed = self.installed | names_with_grads
            self.link.install(self.state, set(self.installed))
            self._seen = StateSeen(self._torch_state)
        # What torch.optim.lr_scheduler checks to know the optimizer stepped.
        self.optimizer._opt_called = True


class TracedOptimizer:
    """The optimizer while its step body is traced: ``step()`` updates the traced
    parameters from their ``.grad`` and carries the new state; ``zero_grad()`` is torch's
    own, over the traced parameters (``param_groups`` hold them meanwhile)."""

    def __init__(
        self,
        linked: LinkedOptimizer,
        placeholders: list[Tensor],
        leaf_of: Callable,
        python: Any = None,
    ):
        self.linked = linked
        self.placeholders = placeholders
        spec = pytree.tree_structure(linked.state)
        self.state = pytree.tree_unflatten(list(placeholders), spec)
        self.leaf_of = leaf_of  # parameter name -> the traced tensor standing for it
        self.stepped: set[str] = set()
        self._saved: dict[str, Any] = {}
        # The body's Python (functacc.core.python_trace.Recorder): hyperparameters it assigns
        # in param_groups before step() are the ones that step uses.
        self.python = python

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Per param group, the graph's inputs for its ``param_groups`` entries (as
        :meth:`OwnStepTrace.hyperparameters <functacc.core.own_step_trace.OwnStepTrace>` gives
        them): ``("number", t)``, or ``("numbers", (t1, t2))`` for ``betas``."""
        out = []
        for s in self.state:
            hyper = dict(getattr(s, "hyperparams", None) or {})
            group = {k: ("number", t) for k, t in hyper.items() if k not in ("beta1", "beta2")}
            if "beta1" in hyper:
                group["betas"] = ("numbers", (hyper["beta1"], hyper["beta2"]))
            out.append(group)
        return out

    def __enter__(self) -> TracedOptimizer:
        opt = self.linked.optimizer
        self._saved = {
            "step": vars(opt).get("step"),
            "groups": [g["params"] for g in opt.param_groups],
        }
        names = self.linked.link.groups
        for group, group_names in zip(opt.param_groups, names, strict=True):
            group["params"] = [self.leaf_of(n) for n in group_names]
        opt.step = self.step  # an instance attribute shadows the class's step
        from .own_step_trace import refuse_state_dicts

        self._undo = refuse_state_dicts(opt)
        self._saved["state"], opt.state = opt.state, state_view(self, opt.state)
        return self

    def __exit__(self, *exc: object) -> None:
        opt = self.linked.optimizer
        self._undo()
        opt.state = self._saved["state"]
        for group, params in zip(opt.param_groups, self._saved["groups"], strict=True):
            group["params"] = params
        if self._saved["step"] is None:
            del opt.step
        else:
            opt.step = self._saved["step"]

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # as torch's step(closure): called once, first, grad on
            with torch.enable_grad():
                loss = closure()
        params = {n: self.leaf_of(n) for g in self.linked.link.groups for n in g}
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        for n, g in grads.items():
            if g.layout != torch.strided:
                raise argument_error(
                    f"the gradient of {n!r} is a {g.layout} tensor; functacc's optimizers "
                    "take dense gradients (build embeddings with sparse=False)."
                )
        with torch.no_grad():
            detached = {n: p.detach() for n, p in params.items()}
            shards = self.linked.sharding
            state = self._with_assigned_hyperparameters()
            if shards is None:
                detached_grads = _marked({n: g.detach() for n, g in grads.items()})
                new_params, new_state = step_params(
                    self.linked.transform, detached_grads, state, detached
                )
            else:  # ZeRO: this rank's segments, then every rank's all-gathered
                grad_segments = {n: g.detach() for n, g in shards.grad_segments(grads).items()}
                segments, new_state = step_params(
                    self.linked.transform, grad_segments, state, shards.param_segments(detached)
                )
                new_params = shards.gather(segments, detached)
            self.state = _keep_hyperparameters(new_state, self.state)
            for n in grads:
                params[n].copy_(new_params[n])
            if shards is not None:
                shards.written(params)
        self.stepped |= set(grads)
        if self.python is not None:
            self.python.stepped(self.linked.optimizer)
        return loss

    @contextlib.contextmanager
    def unless(self, skip: Tensor) -> Iterator[None]:
        """A ``step()`` inside leaves the parameters and state as they were where ``skip``
        (a GradScaler's found inf) is true: each takes ``where(skip, before, after)``."""
        params = {n: self.leaf_of(n) for g in self.linked.link.groups for n in g}
        before = {n: p.detach().clone() for n, p in params.items()}
        state = self.state
        yield
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(torch.where(skip, before[n], p))
            self.state = pytree.tree_map(
                lambda old, new: (
                    torch.where(skip, old, new)
                    if isinstance(new, Tensor) and new is not old
                    else new
                ),
                state,
                self.state,
            )

    def _with_assigned_hyperparameters(self) -> Any:
        """The state, with the hyperparameters the body assigned in ``param_groups`` before
        this step in place of the graph's inputs (constants, or values the graph computes
        from fed Python numbers)."""
        if self.python is None:
            return self.state
        assigned = self.python.overrides(self.linked.optimizer)
        if not any(assigned):
            return self.state
        self._check_structure(assigned)
        groups = []
        for i, (group_state, values) in enumerate(zip(self.state, assigned, strict=True)):
            hyper = dict(getattr(group_state, "hyperparams", None) or {})
            for key, value in values.items():
                names = ("beta1", "beta2") if key == "betas" else (key,)
                if not all(n in hyper for n in names):
                    if key in _STRUCTURE_KEYS:
                        raise argument_error(
                            f"the step assigns {self.linked.label}.param_groups[{i}]"
                            f"[{key!r}] before {self.linked.label}.step(); that setting "
                            "changes which update the traced step runs, which is fixed when "
                            "the step is traced. Fix: set it outside the step (the next call "
                            "traces the new update)."
                        )
                    continue  # not read by the update (initial_lr, a scheduler's max_lr)
                parts = value if key == "betas" else (value,)
                for n, part in zip(names, parts, strict=True):
                    like = hyper[n]
                    if isinstance(part, Tensor):
                        hyper[n] = part.detach().to(like.dtype).reshape(())
                    else:
                        hyper[n] = torch.full((), part, dtype=like.dtype, device=like.device)
            groups.append(group_state._replace(hyperparams=hyper))
        return type(self.state)(groups)

    def _check_structure(self, assigned: list[dict[str, Any]]) -> None:
        """A value assigned in the body that changes which update the twin runs (SGD's
        momentum from 0, a weight decay from 0) is an error: the update was fixed when the
        step was traced."""
        from ..optim._torch import _structure

        opt = self.linked.optimizer
        for i, (group, values) in enumerate(zip(opt.param_groups, assigned, strict=True)):
            plain = {k: v for k, v in values.items() if isinstance(v, (int, float, tuple))}
            if not plain:
                continue
            before = {**dict(getattr(group, "original", group)), "params": []}
            if _structure(opt, {**before, **plain}) != _structure(opt, before):
                raise argument_error(
                    f"the step assigns {opt.__class__.__name__} param_groups[{i}] "
                    f"{sorted(plain)} = {[plain[k] for k in sorted(plain)]} before step(), which "
                    "changes which update functacc's traced step runs (a momentum or weight "
                    "decay from zero to non-zero, or back), fixed when the step was traced. "
                    "Fix: set it outside the step: the next call traces the new update."
                )

    def write_back(self) -> None:
        """At the end of the traced body: the new state goes into the state's inputs
        (functionalization turns these writes into the graph's last ops)."""
        new = pytree.tree_leaves(self.state)
        with torch.no_grad():
            for old, value in zip(self.placeholders, new, strict=True):
                if value is not old:
                    old.copy_(value)


def _marked(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """The gradients as the update takes them, marked: Inductor compiles the update apart
    from forward and backward (``backends/split.py``), as for ``compile_step``, where the
    body steps one optimizer once. Left in one graph, the update fused into the backward's
    kernels (measured on the bench MLP: 2.2 ms per step, against 1.2 ms split)."""
    from ..backends import mark_optimizer_inputs

    names = list(grads)
    return dict(zip(names, mark_optimizer_inputs([grads[n] for n in names]), strict=True))


# param_groups entries that decide which update runs (not values fed to it).
_STRUCTURE_KEYS = frozenset(
    {"nesterov", "maximize", "amsgrad", "foreach", "fused", "capturable", "differentiable"}
) | {"decoupled_weight_decay"}


def _keep_hyperparameters(new: Any, old: Any) -> Any:
    """``new`` with ``old``'s hyperparameter tensors (assigned ones are not written back:
    ``param_groups`` stays the source of them)."""
    if not isinstance(new, tuple) or len(new) != len(old):
        return new
    return type(new)(
        n._replace(hyperparams=o.hyperparams) if hasattr(o, "hyperparams") else n
        for n, o in zip(new, old, strict=True)
    )
