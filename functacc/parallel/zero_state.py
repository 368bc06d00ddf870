"""ZeRO's sharded optimizer state, and how a ``torch.optim`` optimizer shows it whole.

Each rank keeps the optimizer state of its segments only. Resuming from torch's full state
shards it like the parameters; ``optimizer.state_dict()`` gathers it back (a collective
call), so that checkpoints and user code see what data parallelism would hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["ShardedOptimizerState"]


class ShardedOptimizerState:
    """The optimizer-state part of :class:`~functacc.parallel.zero.Sharded` (a mixin: it
    reads the strategy's ``units``, ``segment_of``, ``sharded_names`` and ``topology``)."""

    def shard_optimizer_state(self, named_state: Any, transform: Any, opt_params: dict) -> Any:
        """Shard a named optimizer state (torch's, when resuming) like the parameters: each
        per-parameter tensor becomes its segment; per-parameter scalars (Adam's ``step``)
        stay whole."""
        fresh = transform.init(opt_params)
        out = []
        for fresh_group, named_group in zip(fresh, named_state, strict=True):
            fields = {}
            for field_name in fresh_group._fields:
                new, old = getattr(fresh_group, field_name), getattr(named_group, field_name)
                if isinstance(new, dict) and any(n in self.sharded_names for n in new):
                    fields[field_name] = {
                        name: self._segment_of(name, old[name], like) for name, like in new.items()
                    }
                else:
                    fields[field_name] = old
            out.append(fresh_group._replace(**fields))
        return tuple(out)

    def _segment_of(self, name: str, full: Tensor, like: Tensor) -> Tensor:
        if like.dim() == 0:
            return full.detach().clone().to(like)
        seg = self.segment_of[name]
        return full.detach().reshape(-1)[seg.offset : seg.offset + seg.numel].clone().to(like)

    def full_optimizer_state(self, opt_state: Any) -> tuple:
        """The named, full optimizer state (as data parallelism holds it) from this rank's
        segments: each per-parameter tensor is all-gathered over the shard group, unit by
        unit. A collective call: every rank of the shard group must make it."""
        out = []
        for group_state in opt_state:
            fields = {}
            for field_name in group_state._fields:
                value = getattr(group_state, field_name)
                if isinstance(value, dict) and any(n in self.sharded_names for n in value):
                    fields[field_name] = self._gather_named(value)
                else:
                    fields[field_name] = value
            out.append(group_state._replace(**fields))
        return tuple(out)

    def _gather_named(self, segments: Mapping[str, Tensor]) -> dict[str, Tensor]:
        full: dict[str, Tensor] = {}
        for unit in self.units:
            names = [n for n in unit.names if n in segments]
            vectors = [n for n in names if segments[n].dim() > 0]
            for n in names:
                if segments[n].dim() == 0:
                    full[n] = segments[n].detach().clone()
            if not vectors:
                continue
            like = segments[vectors[0]]
            rank_ = self.topology.shard_rank
            pad = unit.chunk - unit.covered(rank_)
            # A unit's parameter without this state (a transformation's partition steps it
            # with another optimizer) is zeros in the gather, and left out of what it gives.
            pieces = [
                segments[n].detach().reshape(-1)
                if n in segments
                else like.new_zeros(self.segment_of[n].numel)
                for n in unit.names
            ]
            chunk = torch.cat([*pieces, like.new_zeros(pad)])
            flat = self.whole_flat(unit, chunk)
            full.update({n: t.clone() for n, t in unit.unflatten(flat).items() if n in vectors})
        return full

    def link_optimizer(self, link: Any, live: Callable[[], Any], transform: Callable) -> None:
        """Make the ``torch.optim`` optimizer of ``link`` show the full state, as under data
        parallelism: ``optimizer.state_dict()`` gathers it (a collective call: every rank
        must make it) and ``optimizer.load_state_dict()`` shards what it loads into the
        step's state. Between these calls ``optimizer.state`` stays empty (no full copy).
        ``live()`` is the step's current TrainState (``None`` once the step is gone);
        ``transform()`` its optimizer transformation."""
        optimizer = link.optimizer

        def before_state_dict(opt: Any) -> None:
            state = live()
            if state is None:
                return
            full = self.full_optimizer_state(state.opt_state)
            link.install(full, _names_with_state(state.opt_state))

        def after_state_dict(opt: Any, state_dict: dict) -> dict:
            opt.state.clear()  # the returned dict keeps the gathered tensors
            return state_dict

        def after_load(opt: Any) -> None:
            state = live()
            if state is None:
                return
            like = dict(self._param_objects)
            for name in self.sharded_names:  # ZeRO-3 holds empty placeholders in the model
                unit = self.unit_of[name]
                shape = unit.shapes[unit.names.index(name)]
                like[name] = torch.empty(shape, dtype=unit.dtype, device=unit.device)
            named = link.read_state(like, copy=True)
            params = self.optimizer_params(state.params)
            sharded = self.shard_optimizer_state(named, transform(), params)
            with torch.no_grad():
                leaves = pytree.tree_leaves(state.opt_state)
                for old, new in zip(leaves, pytree.tree_leaves(sharded), strict=True):
                    old.copy_(new)
            opt.state.clear()

        optimizer.register_state_dict_pre_hook(before_state_dict)
        optimizer.register_state_dict_post_hook(after_state_dict)
        optimizer.register_load_state_dict_post_hook(after_load)


def _names_with_state(opt_state: Any) -> set[str]:
    """Parameters that have had a gradient (torch.optim creates their state then): Adam's
    step count is positive, SGD's momentum buffer initialised."""
    names = set()
    for group in opt_state:
        if hasattr(group, "step"):
            names.update(n for n, t in group.step.items() if float(t) > 0)
        elif hasattr(group, "initialized"):
            names.update(n for n, t in group.initialized.items() if bool(t))
    return names
