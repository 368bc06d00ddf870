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

import builtins
import contextlib
import copy
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..errors import argument_error
from .python_reach import Location, Root

__all__ = ["OwnStepLink", "OwnStepTrace", "check_traceable", "initial_state"]


class _InitDone(Exception):  # a signal: _init_group has run
    pass


def check_traceable(optimizer: torch.optim.Optimizer, names: Mapping[int, str], label: str) -> None:
    """Refuse what a traced ``step()`` cannot be: LBFGS (its closure runs the forward a
    data-dependent number of times), SparseAdam (sparse gradients), step hooks, and
    parameters of none of the step's modules."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise argument_error(
            f"{label} is torch.optim.LBFGS, whose step(closure) re-runs the forward and "
            "backward a number of times that depends on the values (its line search), which "
            "one traced graph cannot do. Fix: run LBFGS eagerly, or compile only the closure "
            "(functacc.jit of the forward and backward, returning the loss) and call "
            "opt.step(closure) with it outside the jitted step.",
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
        for j, p in enumerate(group["params"]):
            if id(p) not in names:
                raise argument_error(
                    f"{label}.param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)}) "
                    "belongs to none of the modules given to functacc.jit. Add the module "
                    "that owns it to modules=(...)."
                )


def initial_state(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> dict:
    """The state ``optimizer``'s first ``step()`` would create for each of ``params`` that
    has none yet (by name), without changing the optimizer, its parameters or their grads.

    torch's optimizers create it in ``_init_group``: that runs, and the step stops right
    after it. Others are stepped once on a deep copy, whose state dicts note each entry as
    it is first assigned; a second copy stepped from those entries must end bit for bit
    where the first did, else the state cannot be made ahead (``_NotAhead``)."""
    missing = {n: p for n, p in params.items() if not optimizer.state.get(p)}
    if not missing:
        return {}
    if _made_in_init_group(optimizer):
        return _init_group_state(optimizer, missing)
    return _first_assignments(optimizer, missing)


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
        with torch.no_grad():
            type(clone).step(clone)
        params = [p.detach().clone() for g in clone.param_groups for p in g["params"]]
        return recorded, [params, *[dict(r) for r in recorded.values()]]

    recorded, after = stepped_copy(None)
    made = {n: dict(r.first) for n, r in recorded.items()}
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
    clone.param_groups = [
        {**g, "params": [copies[id(p)] for p in g["params"]]} for g in optimizer.param_groups
    ]
    clone.defaults = dict(optimizer.defaults)
    clone.state = defaultdict(dict)
    for p, entries in optimizer.state.items():
        if id(p) in copies:
            clone.state[copies[id(p)]] = {k: _copy(v) for k, v in entries.items()}
    return clone, copies


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
                self.optimizer.state.pop(p, None)
        owners.show_whole(self.optimizer, self.names)
        self._link_up()

    def _link_up(self) -> None:
        opt = self.optimizer
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
            if opt.state.get(p):
                self.store[n] = opt.state[p]  # the optimizer's own dict: written in place
                self.installed.add(n)
            else:
                self.store[n] = made.get(n, {})
        self.roots = {n: _state_root(self.label, n, self.store) for n in self.params}
        self.created = False  # the last call created state entries (written back after it)
        self._entries()
        self._torch_state = opt.state
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
        if opt.state is not self._torch_state or ids != self._ids:
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

    def forget_leaves(self) -> None:
        self._leaves = None

    def install(self, stepped: frozenset[str]) -> None:
        """After a call: ``opt.state`` shows the state of every parameter stepped so far."""
        self._stepped = self._stepped | stepped
        self.settle()
        self.optimizer._opt_called = True  # what lr_scheduler checks

    def settle(self) -> None:
        """Show state that the last call created (its first step, for an optimizer whose
        state could not be made ahead) once it is written back."""
        if self.created:  # new entries: new inputs of the next graph
            self.created = False
            self._entries()
        for n in self.params:  # in parameter order, as eager's first step fills the dict
            if n in self._stepped and n not in self.installed and self.store[n]:
                self.optimizer.state[self.params[n]] = self.store[n]
                self.installed.add(n)


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


class ScalarOf:
    """The number a 0-dim state tensor holds (an optimizer's step count), as a source of a
    fed value: read on the host before each call (a CPU tensor: no device sync)."""

    def __init__(self, location: Location, siblings: Callable[[], list[ScalarOf]]):
        self.location = location
        self.label = f"{location.label}.item()"
        self._siblings = siblings

    @property
    def siblings(self) -> list[ScalarOf]:
        """The same entry of every parameter's state (fed together)."""
        return self._siblings()

    def get(self) -> Any:
        value = self.location.get()
        return value.item() if isinstance(value, Tensor) else value

    def set(self, value: Any) -> None:
        """Nothing to install: the traced step reads the number through ``.item()``."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScalarOf) and self.location == other.location

    def __hash__(self) -> int:
        return hash(("item", self.location))

    def __repr__(self) -> str:
        return f"ScalarOf({self.label})"


class _Scalars(torch.overrides.TorchFunctionMode):
    """While an optimizer's step() is traced: the Python number a 0-dim state tensor holds.

    ``.item()`` of a state scalar that is not fed gives a symbol without a value; each is
    noted (``symbols``), so that a branch on it makes it fed at the next trace. A fed one
    starts as its fed number, follows whole-number increments (``step_t += 1``, exact in
    float32 up to 2**24) and is what ``.item()`` gives; any other write stops that (the
    next ``.item()`` is a symbol without a value again)."""

    def __init__(self, sources: dict[int, ScalarOf], fed: dict[int, Any], symbols: dict):
        super().__init__()
        self.sources, self.values, self.symbols = sources, dict(fed), symbols

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func in _FROM_NUMBER and isinstance(target, (torch.SymFloat, torch.SymInt)):
            # torch.as_tensor(lr / ...) of a fed number: traced as that number's tensor
            # (torch.tensor would fix it to its value at the trace)
            floating = isinstance(target, torch.SymFloat)
            dtype = kwargs.get("dtype") or (torch.get_default_dtype() if floating else torch.int64)
            device = kwargs.get("device")
            return torch.scalar_tensor(target, dtype=dtype, device=device)
        key = id(target)
        if key in self.sources and func in _ITEM:
            if key in self.values:
                value = self.values[key]
                return value  # the fed symbol, or what increments made of it
            result = func(*args, **kwargs)
            if hasattr(result, "node"):
                self.symbols[result.node.expr] = self.sources[key]
            return result
        result = func(*args, **kwargs)
        if key in self.values:
            other = args[1] if len(args) > 1 else kwargs.get("other")
            alpha = kwargs.get("alpha", 1)
            if func in _ADDS and _whole(other) and _whole(alpha):
                self.values[key] = self.values[key] + other * alpha
            elif func in _WRITES or getattr(func, "__name__", "").endswith("_"):
                del self.values[key]
        return result


@contextlib.contextmanager
def symbolic_builtins(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While its step() is traced: ``max``/``min`` in the optimizer's module and ``math``'s
    functions compute with symbols instead of branching on them (Adafactor's
    ``max(eps2, p.norm().item() / ...)``, RAdam's ``math.sqrt``); on plain numbers they are
    Python's own, so the graph computes what eager computes, on the host, in double."""
    cls = type(optimizer)
    names = {cls.__module__, getattr(cls.step, "__module__", None)}
    modules = [sys.modules[n] for n in sorted(filter(None, names)) if n in sys.modules]
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: dict, name: str, value: Any) -> None:
        patched.append((owner, name, owner.get(name, _ABSENT)))
        owner[name] = value

    for module in modules:
        scope = vars(module)
        for name, sym in (("max", torch.sym_max), ("min", torch.sym_min)):
            if name not in scope:  # the builtin, not the module's own
                patch(scope, name, _symbolic(getattr(builtins, name), sym))
    for name in ("sqrt", "cos", "sin", "tan", "acos", "asin", "atan", "cosh", "sinh", "tanh"):
        sym = getattr(torch, f"_sym_{name}", None)
        if sym is not None:
            patch(vars(math), name, _symbolic(getattr(math, name), sym, arity=1))
    try:
        yield
    finally:
        for owner, name, value in reversed(patched):
            if value is _ABSENT:
                del owner[name]
            else:
                owner[name] = value


def _symbolic(python: Callable, sym: Callable, arity: int = 2) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) == arity and not kwargs and any(isinstance(a, _SYMBOLS) for a in args):
            return sym(*args)
        return python(*args, **kwargs)

    return call


_SYMBOLS = (torch.SymInt, torch.SymFloat)
_ITEM = {Tensor.item, Tensor.__float__, Tensor.__int__}
_FROM_NUMBER = {torch.as_tensor, torch.tensor}
_ADDS = {Tensor.add_, Tensor.__iadd__}
_WRITES = {Tensor.copy_, Tensor.fill_, Tensor.zero_, Tensor.__isub__, Tensor.__imul__}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        self._saved_state = opt.state
        for group, names in zip(opt.param_groups, self.link.groups, strict=True):
            group["params"] = [self.leaf_of(n) for n in names]
        state: Any = defaultdict(dict)
        for n in self.link.params:
            state[self.leaf_of(n)] = self.state[n]
        opt.state = state
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
        return self

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise argument_error(
                f"{self.link.label}.step(closure) inside functacc.jit: a closure re-runs the "
                "forward inside step(), a number of times the traced step cannot know. "
                "Compute the loss and call backward() in the step body, then call step() "
                "without a closure."
            )
        opt = self.link.optimizer
        owners = self.link.owners
        self.stepped |= {
            n
            for n in self.link.params
            if self.leaf_of(n).grad is not None and (owners is None or owners.owns(n))
        }
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
        if owners is not None:  # ZeRO-1: this rank steps the parameters it owns
            for group, names in zip(opt.param_groups, self.link.groups, strict=True):
                group["params"] = [self.leaf_of(n) for n in names if owners.owns(n)]
        try:
            with torch.no_grad(), _Scalars(sources, fed, symbols), symbolic_builtins(opt):
                result = type(opt).step(opt)
        finally:
            if owners is not None:
                for group, names in zip(opt.param_groups, self.link.groups, strict=True):
                    group["params"] = [self.leaf_of(n) for n in names]
        if owners is not None:
            with torch.no_grad():
                owners.gather({n: self.leaf_of(n) for n in self.link.params})
        if self.python is not None:
            self.python.stepped(opt)
        return result

    @contextlib.contextmanager
    def unless(self, skip: Tensor) -> Iterator[None]:
        """A ``step()`` inside leaves the parameters and state as they were where ``skip``
        (a GradScaler's found inf) is true: each tensor takes ``where(skip, before,
        after)``, written in place or assigned as the step left it."""
        params = [self.leaf_of(n) for n in self.link.params]
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
        opt.state = self._saved_state
        vars(opt).pop("step", None)

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
