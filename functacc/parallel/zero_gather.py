"""ZeRO-3's just-in-time all-gathers of sharded parameters, inside the traced step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from .comm import all_gather
from .flat import FlatUnit

if TYPE_CHECKING:
    from .zero import Sharded

__all__ = ["Gatherer"]


class Gatherer:
    """ZeRO-3's lazy all-gathers: a forward pre-hook per unit module swaps in the gathered
    weights just before the module runs; a saved-tensor hook stores views of them as
    (unit, layout) and re-gathers in backward instead of keeping the full weights alive."""

    def __init__(self, strategy: Sharded, params: Mapping[str, Tensor], model: nn.Module):
        self.strategy = strategy
        self.params = params
        self.model = model
        self.accessor = NamedMemberAccessor(model)
        self.unit_keys = {u.key for u in strategy.units}
        self.by_module: dict[str, list[FlatUnit]] = {}
        for unit in strategy.units:
            self.by_module.setdefault(unit.module, []).append(unit)
        self.gathered: dict[int, FlatUnit] = {}  # id(full flat tensor) -> unit
        self.regathered: dict[str, Tensor] = {}

    def gather(self, unit: FlatUnit, shard: Tensor) -> Tensor:
        group = self.strategy.topology.shard_group
        return shard if group is None else all_gather(shard, group)

    def pre_hook(self, module_name: str):
        def hook(module: nn.Module, args: Any) -> None:
            for unit in self.by_module[module_name]:
                full = self.gather(unit, self.params[unit.key])
                self.gathered[id(full)] = unit
                for name, view in unit.unflatten(full).items():
                    if not self.strategy._param_objects[name].requires_grad:
                        view = view.detach()  # frozen: no gradient, as in eager
                    elif view.requires_grad:
                        # Which parameters get a gradient (torch.optim skips the others):
                        # the hook runs while backward is traced, only for used views.
                        view.register_hook(self._record(name))
                    for alias in (name, *self.strategy.aliases.get(name, ())):
                        self.accessor.swap_tensor(alias, view)

        return hook

    def _record(self, name: str):
        def hook(grad: Tensor) -> None:
            self.strategy._used.add(name)

        return hook

    def pack(self, t: Tensor) -> Any:
        base = t._base
        if base is not None and id(base) in self.gathered:
            unit = self.gathered[id(base)]
            return ("functacc.regather", unit, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(self, packed: Any) -> Tensor:
        if not (isinstance(packed, tuple) and packed and packed[0] == "functacc.regather"):
            return packed
        _, unit, size, stride, offset = packed
        # One re-gather per unit serves all its saved weights. Keeping the gathered tensor
        # here costs no memory by itself: in the graph a tensor lives from its producer to
        # its last use, and a unit's backward uses are adjacent, except for the root unit
        # (first and last layers), which stays gathered in between, as FSDP keeps its root.
        if unit.key not in self.regathered:
            shard = self.params[unit.key].detach()
            self.regathered[unit.key] = self.gather(unit, shard)
        return self.regathered[unit.key].as_strided(size, stride, offset)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        handles = []
        for module_name in self.by_module:
            module = self.model.get_submodule(module_name)
            handles.append(module.register_forward_pre_hook(self.pre_hook(module_name)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for handle in handles:
                handle.remove()
