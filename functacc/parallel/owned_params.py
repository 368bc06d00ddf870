"""ZeRO-1 for an optimizer that ``jit`` traces whole: each rank owns whole parameters.

functacc's twins of SGD, Adam and AdamW update any flat segment of a parameter, so
:mod:`.zero_jit` gives each rank a chunk of every flat unit. An optimizer stepped through
its own ``step()`` (:mod:`functacc.core.own_step`) may read a parameter whole — Adafactor's
row and column factors, LAMB's trust ratio, Muon's Newton-Schulz on a matrix — so here each
rank owns whole parameters instead (assigned largest first to the rank holding the fewest
elements so far, the same on every rank), keeps the optimizer state of those only and
steps only those, after the gradients were averaged over the ranks (as under data
parallel). The new values are all-gathered in one collective inside the graph: each rank
packs its parameters into a flat buffer of the largest rank's size, and every rank unpacks
every rank's. ``optimizer.state_dict()`` gathers the whole state (a collective call: every
rank makes it), ``load_state_dict()`` keeps this rank's part.

Example:
    >>> import torch
    >>> owners = assign_owners({"a": torch.zeros(6), "b": torch.zeros(4), "c": torch.zeros(3)}, 2)
    >>> owners
    {'a': 0, 'b': 1, 'c': 1}
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["OwnedGradients", "ParameterOwners", "assign_owners"]


def assign_owners(params: Mapping[str, Tensor], world: int) -> dict[str, int]:
    """Each parameter's rank: largest first, to the rank with the fewest elements so far
    (ties to the lowest rank); the result depends only on the names and sizes."""
    load = [0] * world
    owners: dict[str, int] = {}
    for name in sorted(params, key=lambda n: (-params[n].numel(), n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += params[name].numel()
    return {n: owners[n] for n in params}


class ParameterOwners:
    """Whole-parameter ownership of one optimizer's parameters over the ranks."""

    def __init__(self, params: Mapping[str, Tensor], group: Any = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.owner = assign_owners(params, self.world)
        self.by_rank = [[n for n in params if self.owner[n] == r] for r in range(self.world)]
        self.shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.numel = {n: p.numel() for n, p in params.items()}
        sizes = [sum(params[n].numel() for n in names) for names in self.by_rank]
        self.width = max(sizes) if sizes else 0  # the flat buffer each rank contributes

    def owns(self, name: str) -> bool:
        return self.owner[name] == self.rank

    def gather(self, leaves: Mapping[str, Tensor]) -> None:
        """In the traced step, after this rank updated its parameters: every rank's new
        values into ``leaves`` (one all-gather)."""
        from torch.distributed import _functional_collectives as funcol

        mine = [leaves[n].detach().reshape(-1) for n in self.by_rank[self.rank]]
        first = next(iter(leaves.values()))
        pad = self.width - sum(t.numel() for t in mine)
        flat = torch.cat([*mine, first.new_zeros(pad).reshape(-1)]) if mine or pad else first
        gathered = funcol.all_gather_tensor(flat, 0, self.group or dist.group.WORLD)
        gathered = funcol.wait_tensor(gathered)
        for rank, names in enumerate(self.by_rank):
            if rank == self.rank:
                continue
            offset = rank * self.width
            for n in names:
                t = leaves[n]
                t.copy_(gathered[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def show_whole(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> None:
        """``state_dict()`` gathers every rank's state (collective); ``load_state_dict()``
        keeps this rank's."""
        owners = weakref.ref(self)

        def gather_state(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
            if owners() is None:
                return state_dict
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, state_dict["state"], group=self.group)
            merged = {}
            for part in parts:
                merged.update(part)
            state_dict["state"] = dict(sorted(merged.items()))
            return state_dict

        def keep_own(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
            if owners() is None:
                return state_dict
            index = [names[id(p)] for g in opt.param_groups for p in g["params"]]
            state = {k: v for k, v in state_dict["state"].items() if self.owns(index[int(k)])}
            return {**state_dict, "state": state}

        optimizer.register_state_dict_post_hook(gather_state)
        optimizer.register_load_state_dict_pre_hook(keep_own)


class OwnedGradients:
    """ZeRO-2 for optimizers traced whole: each ``backward()`` reduces each of their
    parameters' gradients to the rank that owns the parameter (one reduce-scatter of a
    buffer packed by owner: each rank receives the mean of its own parameters' gradients,
    which is what its ``opt.step()`` reads); on every rank ``.grad`` is the all-gathered
    whole, which the graph drops where nothing reads it (a body that clips reads it). These
    gradients do not outlive the call (``.grad`` is ``None`` after it), as under
    :class:`~.jit_grads.ShardedGradients`. Other parameters' gradients are averaged whole
    by ``averaged`` (:class:`~.jit_grads.AveragedGradients`)."""

    def __init__(self, averaged: Any, owners: list[ParameterOwners]):
        self.averaged = averaged
        self.owners = owners
        self.owner_of = {n: o for o in owners for n in o.owner}
        self.transient = frozenset(self.owner_of)

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.averaged.sync_buffers(buffers)

    def reducing_backward(
        self, leaves: Mapping[str, Tensor], carried: Mapping[str, Tensor] | None = None
    ) -> Any:
        return type(self.averaged).reducing_backward(self, leaves)

    def reset(self) -> None:
        """A new trace starts."""

    def after_backward(
        self, before: Mapping[str, Tensor | None], fresh: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        from torch.distributed import _functional_collectives as funcol

        others = {n: g for n, g in before.items() if n not in self.owner_of}
        whole = {n: g for n, g in fresh.items() if n not in self.owner_of}
        out = self.averaged.after_backward(others, whole)
        out.update({n: g for n, g in before.items() if n in self.owner_of})
        for owners in self.owners:
            mine = {n: fresh[n] for n in owners.owner if n in fresh}
            if not mine:
                continue
            like = next(iter(mine.values()))
            parts = []
            for names in owners.by_rank:
                pieces = [
                    (mine[n] if n in mine else like.new_zeros(owners.shapes[n])).reshape(-1)
                    for n in names
                ]
                pad = owners.width - sum(p.numel() for p in pieces)
                parts.append(torch.cat([*pieces, like.new_zeros(pad)]))
            group = owners.group or dist.group.WORLD
            chunk = (
                funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.cat(parts), "sum", 0, group))
                / owners.world
            )
            gathered = funcol.wait_tensor(funcol.all_gather_tensor(chunk, 0, group))
            for rank, names in enumerate(owners.by_rank):
                source = chunk if rank == owners.rank else gathered[rank * owners.width :]
                offset = 0
                for n in names:
                    size = owners.numel[n]
                    if n in mine:
                        grad = source[offset : offset + size].view(owners.shapes[n])
                        old = before.get(n)
                        out[n] = grad if old is None else old + grad
                    offset += size
        return out
