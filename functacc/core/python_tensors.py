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

Not fed, and still refused with advice (:func:`~.body_trace.outside_tensor_error`): a tensor
that requires grad (a parameter list taken before the call, a tensor with autograd
history: eager's backward would reach it, a graph input cannot), and the step's own state
(parameters, buffers, optimizer state) reached through a plain object.

Example:
    >>> import torch
    >>> from functacc.core.python_reach import Location, Root
    >>> hidden = (torch.zeros(2), torch.ones(2))
    >>> root = Root("closure variable 'hidden'", lambda: hidden, None)
    >>> [loc.label for loc in tensor_locations(Location(root), hidden, set())]
    ["closure variable 'hidden'[0]", "closure variable 'hidden'[1]"]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

from .python_location import Location, Root
from .python_reach import MODULE_TABLES

__all__ = [
    "fed_key",
    "feedable",
    "installed",
    "module_containers",
    "optimizer_tensors",
    "owned_tensors",
    "tensor_locations",
]


def feedable(value: Any, owned: set[int]) -> bool:
    """Whether ``value`` is a tensor the graph can take as an input in its place: a plain
    tensor (not one of the trace's), not requiring grad, not the step's own state."""
    return type(value) is Tensor and not value.requires_grad and id(value) not in owned


def tensor_locations(location: Location, value: Any, owned: set[int]) -> list[Location]:
    """The locations to feed for ``value`` read at ``location``: itself for a tensor, its
    items for a tuple of them (a tuple cannot be changed in place; it is rebuilt)."""
    if feedable(value, owned):
        return [location]
    if isinstance(value, tuple):
        return [location.child("item", i) for i, v in enumerate(value) if feedable(v, owned)]
    return []


def fed_key(value: Any) -> tuple:
    """A fed location's part of the signature: a tensor's layout, a number's type."""
    if isinstance(value, Tensor):
        return ("fed tensor", tuple(value.shape), value.dtype, value.device, value.stride())
    return ("fed", type(value).__name__)


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
    (``Recorder.install_loose``) and where a module keeps one as an attribute."""
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
