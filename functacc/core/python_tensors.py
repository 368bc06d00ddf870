"""Tensors a step body reads from its Python state: inputs of the graph, read every call.

Eager reads ``self.hidden`` (a recurrent state carried across calls), ``meter.sum`` (a
running total kept as a tensor) or a closure's ``mask`` afresh on every call. A trace that
took them as they were would bake their values into the graph. So a tensor the body reads
from a variable, an attribute of a plain object, a dict entry or a list item (or an item of
a tuple kept there: an LSTM's ``(h, c)``) is *fed*: the first trace that reads it traces
again with that location as a graph input, and every call passes the tensor held there
then. Its shape, dtype, device and strides are part of the step's signature (another
shape traces again). What the body writes there comes back as eager leaves it: a new
tensor assigned is the graph's output, written after the call; an in-place update
(``meter.sum += loss.detach()``) is written into the tensor itself, which stays the same
object.

A leaf tensor that requires grad (an EMA's ``copy.deepcopy`` of the parameters) is fed
requiring grad; a backward that reaches it is refused (:class:`FedRequiringGrad`). A
tensor with autograd history is not fed (eager's backward would reach through it, a graph
input cannot), refused with advice. The step's own state (parameters, buffers) where the
body's Python holds it (``params = list(model.parameters())`` before the call) is not fed
either: those places hold the traced tensors while traced (:func:`install_held`).

Example:
    >>> import torch
    >>> from functacc.core.python_reach import Location, Root
    >>> hidden = (torch.zeros(2), torch.ones(2))
    >>> root = Root("closure variable 'hidden'", lambda: hidden, None)
    >>> [loc.label for loc in tensor_locations(Location(root), hidden, set())]
    ["closure variable 'hidden'[0]", "closure variable 'hidden'[1]"]
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

from ..errors import TraceError
from .python_location import Location, Root
from .python_reach import MODULE_TABLES

__all__ = [
    "FedRequiringGrad",
    "HeldTensors",
    "fed_key",
    "feedable",
    "install_held",
    "installed",
    "module_containers",
    "optimizer_tensors",
    "owned_tensors",
    "tensor_locations",
]


def feedable(value: Any, owned: set[int]) -> bool:
    """Whether ``value`` is a tensor the graph can take as an input in its place: a plain
    tensor or parameter (not one of the trace's), not the step's own state, and where it
    requires grad a leaf without ``.grad`` (an EMA's ``copy.deepcopy`` of the parameters,
    updated in place under ``no_grad``; traced requiring grad: :class:`FedRequiringGrad`)."""
    if type(value) not in (Tensor, nn.Parameter) or id(value) in owned:
        return False
    if not value.requires_grad:
        return True
    try:
        return value.is_leaf and value.grad is None
    except RuntimeError:  # a view made under no_grad whose base changed since: not a leaf
        return False


def tensor_locations(location: Location, value: Any, owned: set[int]) -> list[Location]:
    """The locations to feed for ``value`` read at ``location``: itself for a tensor, its
    items for a tuple of them (a tuple cannot be changed in place; it is rebuilt)."""
    if feedable(value, owned):
        return [location]
    if isinstance(value, tuple):
        return [location.child("item", i) for i, v in enumerate(value) if feedable(v, owned)]
    return []


def fed_key(value: Any) -> tuple:
    """A fed location's part of the signature: a tensor's layout (and whether it requires
    grad), a number's type."""
    if isinstance(value, Tensor):
        layout = (tuple(value.shape), value.dtype, value.device, value.stride())
        return ("fed tensor", *layout, value.requires_grad)
    return ("fed", type(value).__name__)


class HeldTensors(dict):
    """Where the body's Python holds the step's own tensors (location -> the tensor put
    back there after each trace: ``Recorder.install_held``), checked on every call
    (:meth:`moved`, part of the signature): a tensor no longer there means another trace.
    Grouped by the container that holds them, so that a list of 150 parameters costs one
    lookup of the list and 150 identity checks (~10 us), not 150 walks from the root."""

    def __init__(self) -> None:
        super().__init__()
        self._groups: list[tuple[Location | None, list, list, list[Tensor]]] | None = None

    def update(self, found: Any = (), /, **more: Any) -> None:
        super().update(found, **more)
        self._groups = None

    def moved(self) -> tuple[str, ...]:
        """The labels of the locations that no longer hold their tensor (normally none)."""
        if self._groups is None:
            groups: dict[Location | None, list] = {}
            for location, tensor in self.items():
                parent = Location(location.root, location.steps[:-1]) if location.steps else None
                groups.setdefault(parent, []).append((location, tensor))
            self._groups = [
                (
                    parent
                    if parent and all(loc.steps[-1][0] == "item" for loc, _ in held)
                    else None,
                    held,
                    [loc.steps[-1][1] if loc.steps else None for loc, _ in held],
                    [t for _, t in held],
                )
                for parent, held in groups.items()
            ]
        moved: list[str] = []
        for parent, held, keys, tensors in self._groups:
            if parent is not None:
                container = parent.get()  # a list's (a dict's) items: the fast path
                try:
                    if all(map(operator.is_, map(container.__getitem__, keys), tensors)):
                        continue
                except Exception:  # gone, or not a container any more
                    pass
            moved += [loc.label for loc, t in held if loc.get() is not t]
        return tuple(moved)


class FedRequiringGrad(list):
    """The fed tensors that require grad (an EMA's ``copy.deepcopy`` of the parameters),
    as ``(location, graph input)``: made when a trace starts (``fed``: location -> graph
    input, before they are installed), their graph inputs made to require grad too, as in
    eager, where a backward that reaches one accumulates into its ``.grad``."""

    def __init__(self, fed: dict[Location, Any]) -> None:
        super().__init__()
        for location, traced in fed.items():
            value = location.get()
            if isinstance(traced, Tensor) and isinstance(value, Tensor) and value.requires_grad:
                traced.requires_grad_(True)
                traced._functacc_parameter = isinstance(value, nn.Parameter)  # print(ema_p)
                self.append((location, traced))

    def check(self) -> None:
        """After the body: refuse a gradient computed for one of them. Its graph input's
        ``.grad`` is not written back anywhere, where eager's ``.grad`` holds it (and an
        optimizer would read it)."""
        reached = [location.label for location, traced in self if traced.grad is not None]
        if reached:
            raise TraceError(
                f"backward() computed a gradient for the tensor at {', '.join(reached[:4])}, "
                "which the step reads from its Python state: it requires grad, but it is no "
                "parameter of the modules given in modules=(...) nor of the optimizers in "
                "optimizers=(...), so functacc.jit cannot keep its .grad as eager does. Fix: "
                "give the optimizer that updates it in optimizers=(...) (its tensors are then "
                "the step's own), or make it an nn.Parameter of a module given in "
                "modules=(...) (or give the module that holds it); where it should not be "
                "trained, set requires_grad_(False) on it or compute with it under "
                "torch.no_grad()."
            )


def install_held(
    found: Iterable[tuple[Location, Any]], leaves: dict[int, Tensor], originals: dict[int, Any]
) -> dict[Location, Tensor]:
    """While a body is traced: the step's own tensors (parameters, buffers, optimizer-only
    tensors such as SAC's ``log_alpha``) where its Python holds them outside the modules
    (``found``: the tensors and tuples its variables and plain objects hold, with their
    locations) replaced by the traced tensor for each (``leaves``, by the tensor's id); a
    tuple's items too (``list(model.named_parameters())``). Returns where, with the tensor
    put back there after the trace (a call that finds another one there traces again)."""
    done: dict[Location, Tensor] = {}
    for location, value in found:
        pairs = enumerate(value) if isinstance(value, tuple) else [(None, value)]
        for i, v in pairs:
            if isinstance(v, Tensor) and id(v) in leaves:
                at = location if i is None else location.child("item", i)
                installed(at, leaves[id(v)], originals)
                done[at] = v
    return done


def installed(location: Location, value: Any, originals: dict[int, Any]) -> None:
    """Put a fed value (a number's symbol, a tensor's graph input) where the body reads it.
    ``originals`` learns what an installed tensor, or a tuple rebuilt around one, stands
    for: the body leaving it there (or updating it in place) writes nothing back."""
    if not isinstance(value, Tensor):
        location.set(value)
        return
    originals[id(value)] = location.get()
    parent = Location(location.root, location.steps[:-1]) if location.steps else None
    before = parent.get() if parent is not None else None
    location.set(value)
    if isinstance(before, tuple):
        originals[id(parent.get())] = originals.get(id(before), before)


def owned_tensors(modules: Sequence[nn.Module], optimizers: Sequence[Any]) -> set[int]:
    """The ids of the step's own tensors: its modules' parameters and buffers, and its
    optimizers' state (``optimizers``: linked optimizers, each with ``.optimizer``)."""
    ids = {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    for linked in optimizers:
        for group in getattr(getattr(linked, "optimizer", None), "param_groups", ()):
            ids.update(id(p) for p in group["params"])  # SAC's log_alpha no module owns
        for state in getattr(getattr(linked, "optimizer", None), "state", {}).values():
            values = state.values() if isinstance(state, dict) else ()
            ids.update(id(v) for v in values if isinstance(v, Tensor))
    return ids


def optimizer_tensors(
    optimizers: Sequence[Any], labels: Sequence[str], seen: dict[int, str]
) -> list[Tensor]:
    """The tensors the optimizers update that no module owns (SAC's ``log_alpha =
    torch.zeros(1, requires_grad=True)``). ``seen`` maps the modules' tensors to their
    names, by id; it learns these too, named by their place in the optimizer
    (``opt.param_groups[0]['params'][2]``). They are parameters of the step; each trace
    puts the traced tensor where the body's variables and plain objects hold them
    (``Recorder.install_held``) and where a module keeps one as an attribute."""
    found: list[Tensor] = []
    for opt, label in zip(optimizers, labels, strict=True):
        for i, group in enumerate(getattr(opt, "param_groups", ())):
            for j, p in enumerate(group["params"]):
                if type(p) is Tensor and id(p) not in seen:  # a Parameter: its module's
                    seen[id(p)] = f"{label}.param_groups[{i}]['params'][{j}]"
                    found.append(p)
    return found


def module_containers(modules: Iterable[tuple[str, nn.Module]]) -> list[Root]:
    """The lists and dicts the step's modules keep as public plain attributes
    (torchvision's ``AnchorGenerator.cell_anchors``, a list of tensors; a dict of
    masks): roots of the Python state, so that the tensors read from them are fed to the
    graph on every call, as a closure's are. A ``_private`` one only where it holds tensors
    and the module is not torch's own (a torchmetrics ``Metric``'s ``_defaults``, which
    ``reset()`` clones): not a module's bookkeeping (``nn.LSTM._flat_weights``, the
    parameter tables). ``modules``: (label, module) pairs."""
    roots: list[Root] = []
    for label, module in modules:
        for name, sub in module.named_modules():
            for attr, value in vars(sub).items():
                if type(value) in (list, dict) and _held_by_user(sub, attr, value):
                    roots.append(
                        _attribute_root(".".join(filter(None, [label, name, attr])), sub, attr)
                    )
    return roots


def _held_by_user(module: nn.Module, attr: str, value: list | dict) -> bool:
    if not attr.startswith("_"):
        return True
    items = value.values() if isinstance(value, dict) else value
    torchs = type(module).__module__.startswith("torch.")
    return not torchs and attr not in MODULE_TABLES and any(isinstance(v, Tensor) for v in items)


def _attribute_root(label: str, module: nn.Module, attr: str) -> Root:
    def set_(value: Any) -> None:
        vars(module)[attr] = value

    return Root(f"attribute {label}", lambda: vars(module).get(attr), set_, loaded=False)
