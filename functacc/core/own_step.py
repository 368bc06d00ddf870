"""``opt.step()`` inside a traced step: the optimizer's own code, traced.

Any ``torch.optim.Optimizer`` — torch's own (RMSprop, Adagrad, NAdam, RAdam, Adafactor,
Muon, ...) and third parties' (timm's Lamb, Lion, ...) — runs its real ``step()`` while the
step body is traced, over state that is the graph's input:

- **its state** (``opt.state[p]``): every tensor is an input, updated in place by the graph
  (the very tensors ``opt.state`` holds, so ``state_dict()`` is torch's). State that the
  first ``step()`` would create lazily is created before the first trace, as that step
  creates it (:func:`initial_state`), and shown in ``opt.state`` once its parameter stepped,
  as eager shows it. Numbers kept in the state (a third party's ``state["step"] += 1``)
  are followed like any Python value of the body (:mod:`.python_state`);
- **its hyperparameters**: every number of ``param_groups`` (``lr``, ``betas``, ``eps``,
  ``momentum``, a third party's ``group["step"]``, ...) is fed as a 0-dim input on every
  call, so a schedule changes them without a retrace; its ``step()`` computes with them as
  eager does, in Python floats (the graph evaluates that arithmetic on the host, in double,
  as eager). A value it branches on (``if weight_decay != 0``) is guarded instead: a change
  retraces. Flags and other values (``maximize``, ``foreach``) are guarded.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    >>> state = initial_state(opt, dict(model.named_parameters()))
    >>> sorted(state["weight"]), len(opt.state)  # created as step() would, not shown yet
    (['square_avg', 'step'], 0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import argument_error
from ..optim._torch import check_owned_parameters
from .own_step_state import _NotAhead, initial_state, state_holder
from .python_location import Location, Root
from .scalar_reads import ScalarOf
from .state_seen import StateSeen

__all__ = ["LBFGS_ADVICE", "OwnStepLink", "check_traceable"]

# Tested: pytorch/examples' time_sequence_prediction this way equals its eager loop.
LBFGS_ADVICE = (
    "jit only the closure, with the batch as its arguments and the model's zero_grad() "
    "in place of the optimizer's, and step LBFGS outside: closure = functacc.jit(lambda x, "
    "y: ..., modules=[model]) (model.zero_grad(); loss = criterion(model(x), y); "
    "loss.backward(); return loss), then opt.step(lambda: closure(x, y))."
)


def check_traceable(optimizer: torch.optim.Optimizer, names: Mapping[int, str], label: str) -> None:
    """Refuse what a traced ``step()`` cannot be: LBFGS (its closure runs the forward a
    data-dependent number of times), SparseAdam (sparse gradients), step hooks, and
    parameters of none of the step's modules."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise argument_error(
            f"{label} is torch.optim.LBFGS, whose step(closure) re-runs the forward and "
            "backward a number of times that depends on the values (its line search), which "
            f"one traced graph cannot do. Fix: {LBFGS_ADVICE}",
            TypeError,
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise argument_error(
            f"{label} is torch.optim.SparseAdam, which takes sparse gradients; functacc's "
            "graphs hold dense ones. Fix: build the embedding with sparse=False and use "
            "torch.optim.Adam (or AdamW), or keep SparseAdam eager.",
            TypeError,
        )
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise argument_error(
            f"{label} has step hooks (register_step_pre_hook / register_step_post_hook); a "
            "jitted step runs the optimizer's update inside its graph, where those Python "
            "hooks would run once, when traced. Remove them (handle.remove())."
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise argument_error(
                f"{label}.param_groups[{i}] has differentiable=True, which functacc does not "
                "support (the optimizer step is not differentiated through); create the "
                "optimizer with differentiable=False."
            )
    check_owned_parameters(optimizer, names, label)


# -- across calls --------------------------------------------------------------------------
def _fed(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Groups:
    """What ZeRO and the gradient strategies read of a link: the parameter names per group."""

    def __init__(self, groups: list[list[str]]):
        self.groups = groups


class OwnStepLink:
    """One optimizer whose own ``step()`` is traced, and its live state (see the module
    docstring). ``names`` maps each parameter (by ``id``) to its name among the modules."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str], label: str):
        self.optimizer = optimizer
        self.holder = state_holder(optimizer)  # whose .state: the optimizer a wrapper wraps
        self.label = label
        self.names = names
        self.sharding: Any = None
        self.owners: Any = None  # ZeRO-1: functacc.parallel.owned_params.ParameterOwners
        self._link_up()

    def shard(self, owners: Any) -> None:
        """Keep, and step, only the parameters this rank owns (ZeRO-1, whole parameters)."""
        self.owners = owners
        for n, p in self.params.items():
            if not owners.owns(n):
                self.holder.state.pop(p, None)
        owners.show_whole(self.optimizer, self.names)
        self._link_up()

    def _link_up(self) -> None:
        opt = self.optimizer
        check_owned_parameters(opt, self.names, self.label)  # add_param_group: every call
        self.groups = [[self.names[id(p)] for p in g["params"]] for g in opt.param_groups]
        self.link = _Groups(self.groups)
        self.params = {self.names[id(p)]: p for g in opt.param_groups for p in g["params"]}
        owned = {n: p for n, p in self.params.items() if self.owners is None or self.owners.owns(n)}
        try:
            made = initial_state(opt, owned)
        except _NotAhead:
            # Its first step() creates state it treats differently from state that exists
            # (timm's Adopt: `first = len(state) == 0`): the first trace creates it, as the
            # graph's outputs, and the second call traces the steps that follow.
            made = {}
        self.store: dict[str, dict] = {}
        self.installed: set[str] = set()
        self._stepped: frozenset[str] = frozenset()
        for n, p in self.params.items():
            if self.holder.state.get(p):
                self.store[n] = self.holder.state[p]  # its own dict: written in place
                self.installed.add(n)
            else:
                self.store[n] = made.get(n, {})
        self.roots = {n: _state_root(self.label, n, self.store) for n in self.params}
        self.created = False  # the last call created state entries (written back after it)
        self._entries()
        self._torch_state = self.holder.state
        self._seen = StateSeen(self._torch_state)
        self._ids = [[id(p) for p in g["params"]] for g in opt.param_groups]
        self.tensors: list[dict[str, Tensor]] = []  # per group: its tensor entries (inputs)
        self._values: list[dict[str, Any]] = []
        self._leaves: tuple[list[str], list[Tensor]] | None = None
        self._structure = self._sync()

    def _sync(self) -> tuple:
        """Read ``param_groups``: the tensor entries (inputs of the graph; numbers are fed as
        Python values, :meth:`numbers`), and the structure key: each entry's kind."""
        structure, tensors, values = [], [], []
        for group in self.optimizer.param_groups:
            entries = {k: v for k, v in group.items() if k != "params"}
            structure.append(tuple((k, _kind(v)) for k, v in entries.items()))
            tensors.append({k: v for k, v in entries.items() if isinstance(v, Tensor)})
            values.append(entries)
        if [list(t) for t in tensors] != [list(t) for t in self.tensors] or any(
            a[k] is not b[k] for a, b in zip(tensors, self.tensors, strict=False) for k in a
        ):
            self._leaves = None
        self.tensors, self._values = tensors, values
        return tuple(structure)

    def numbers(self, root: Root) -> list[Location]:
        """The ``param_groups`` numbers that schedules change (``lr``, ``momentum``,
        ``betas``: torch's schedulers, OneCycleLR's and CyclicLR's momentum cycling), as
        locations under ``root``: fed to the graph from the first call. Every other number
        (``eps``, Muon's coefficients) is guarded, and fed from the first change on, as any
        Python value the step reads (constants stay constants for Inductor's kernels)."""
        out = []
        for i, group in enumerate(self.optimizer.param_groups):
            for key, value in group.items():
                if key not in _SCHEDULED:
                    continue
                loc = Location(root, (("item", i), ("item", key)))
                if _fed(value):
                    out.append(loc)
                elif (_kind(value) or "").startswith("numbers"):
                    out.extend(loc.child("item", j) for j in range(len(value)))
        return out

    def refresh(self) -> tuple:
        """Follow what changed between calls (``load_state_dict``, new groups, an entry of
        another kind); returns the structure key (a new one: a new graph)."""
        opt = self.optimizer
        ids = [[id(p) for p in g["params"]] for g in opt.param_groups]
        state = self.holder.state
        # Also a state changed in place (clear(), del, an entry replaced): read it again.
        if state is not self._torch_state or ids != self._ids or not self._seen.holds(state):
            self._link_up()
            return self._structure
        current = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if current != self._values:
            self._structure = self._sync()
        return self._structure

    def leaves(self) -> tuple[list[str], list[Tensor]]:
        """The state's tensors, then the tensor entries of ``param_groups``, with paths."""
        if self._leaves is None:
            paths, tensors = [], []
            for n, entries in self.store.items():
                for key, value in entries.items():
                    if isinstance(value, Tensor):
                        paths.append(f".state[{n!r}][{key!r}]")
                        tensors.append(value)
            for i, entries in enumerate(self.tensors):
                for key, value in entries.items():
                    paths.append(f".param_groups[{i}][{key!r}]")
                    tensors.append(value)
            self._leaves = (paths, tensors)
        return self._leaves

    def _entries(self) -> None:
        """The 0-dim CPU tensors of the state (numbers the step may read with ``.item()``)."""
        self.scalars = {
            (n, key): ScalarOf(Location(self.roots[n], (("item", key),)), self._siblings(key))
            for n, entries in self.store.items()
            for key, value in entries.items()
            if isinstance(value, Tensor) and value.dim() == 0 and value.device.type == "cpu"
        }
        self._leaves = None

    def _siblings(self, key: str) -> Callable[[], list[ScalarOf]]:
        return lambda: [s for (n, k), s in self.scalars.items() if k == key]

    def install(self, stepped: frozenset[str]) -> None:
        """After a call: ``opt.state`` shows the state of every parameter stepped so far."""
        self._stepped = self._stepped | stepped
        self.settle()
        self.optimizer._opt_called = True  # what lr_scheduler checks

    def settle(self) -> None:
        """Show state that the last call created (its first step, for an optimizer whose
        state could not be made ahead) once it is written back."""
        shown = self.created
        if self.created:  # new entries: new inputs of the next graph
            self.created = False
            self._entries()
        for n in self.params:  # in parameter order, as eager's first step fills the dict
            if n in self._stepped and n not in self.installed and self.store[n]:
                self.holder.state[self.params[n]] = self.store[n]
                self.installed.add(n)
                shown = True
        if shown:
            self._seen = StateSeen(self._torch_state)


_SCHEDULED = frozenset({"lr", "momentum", "betas"})


def _state_root(label: str, name: str, store: dict[str, dict]) -> Root:
    root = Root(f"{label}.state[{name!r}]", lambda: store[name], None)
    root.external = True  # OwnStepTrace gives the traced step its values
    return root


def _kind(value: Any) -> str | None:
    if _fed(value):
        return "float" if isinstance(value, float) else "int"
    if type(value) in (tuple, list) and value and all(_fed(v) for v in value):
        return f"numbers{len(value)}"
    if isinstance(value, Tensor):
        return "tensor"
    return None
