"""ZeRO stage 3 for :func:`functacc.jit`: between calls, each rank keeps only its chunk of
the parameters that the step's ``torch.optim`` optimizers update.

Under ``jit(..., parallel=ZeRO(3))`` those parameters live as one flat chunk per ZeRO unit
(:mod:`.flat`: a unit per ``wrap_layer_cls`` module and param group, the rest one unit), and
the modules hold empty placeholders, so a model, its gradients and Adam's moments take
1/world of their memory on each rank between steps. Inside the step the chunks are
all-gathered into whole parameters that the body uses as eager code does (forward passes,
``p.grad``, ``torch.autograd.grad``, in-place EMA or clipping): gradients and optimizer
state then follow ZeRO-2 (each ``backward()`` reduce-scatters, each ``opt.step()`` updates
this rank's segments), and the call ends by writing this rank's chunk of the new
parameters, taken from the update itself unless the body wrote the parameters after it.
In the graph each gather sits where the step first reads the unit's parameters.

Parameters that no optimizer of the step updates (a frozen teacher, an EMA copy) stay whole.
:meth:`ShardedParameters.gather_modules` (``step.sync_modules()``) puts the whole parameters
back into the modules for code outside the step (evaluation, ``state_dict()``); the next call
shards them again from what the modules then hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .comm import all_gather
from .flat import FlatUnit

if TYPE_CHECKING:
    from .zero import Sharded, ZeRO
    from .zero_jit import ShardedOptimizer

__all__ = ["ShardedParameters", "as_stage2", "check_zero3_optimizers"]

_REGATHER = object()  # marks a saved tensor that backward gathers again


def as_stage2(config: ZeRO) -> ZeRO:
    """The layout of gradients and optimizer state under jit's ZeRO-3: stage 2's."""
    return dataclasses.replace(config, stage=2)


class ShardedParameters:
    """The chunks of the parameters that ``optimizers`` (one
    :class:`~.zero_jit.ShardedOptimizer` per ``torch.optim`` optimizer of the step) update,
    kept between calls in place of ``params`` (the step's parameters by name), which are
    emptied.

    Example:
        >>> import torch, functacc
        >>> from functacc.parallel.zero_jit import ShardedOptimizer
        >>> holder = torch.nn.ModuleDict({"model": torch.nn.Linear(4, 3)})
        >>> shards = ShardedOptimizer(functacc.parallel.ZeRO(2), holder, [["model.weight"]])
        >>> params = dict(holder.named_parameters())
        >>> rest = ShardedParameters([shards], params)
        >>> params["model.weight"].shape, [tuple(c.shape) for c in rest.chunks.values()]
        (torch.Size([0]), [(12,)])
        >>> rest.gather_modules(); params["model.weight"].shape
        torch.Size([3, 4])
    """

    def __init__(self, optimizers: Sequence[ShardedOptimizer], params: Mapping[str, Tensor]):
        self.params = dict(params)
        self.units: list[tuple[str, Sharded, FlatUnit]] = []
        for i, owner in enumerate(optimizers):
            owner.rest = self
            for unit in owner.sharded.units:
                self.units.append((f"shard {i}:{unit.key}", owner.sharded, unit))
        self.by_key = {key: (sharded, unit) for key, sharded, unit in self.units}
        self.key_of = {n: key for key, _, unit in self.units for n in unit.names}
        self.names = frozenset(self.key_of)
        self.chunks: dict[str, Tensor] = {}
        self._like: dict[str, Tensor] = {}
        self._full = True
        # While tracing: the chunk inputs, the whole parameters gathered from them, their
        # version counters then, and each unit's chunk as an optimizer's update left it.
        self._inputs: dict[str, Tensor] = {}
        self._initial: dict[str, int] = {}
        self._updated: dict[str, tuple[Tensor, list[int] | None]] = {}
        self._leaf_names: dict[int, str] = {}
        self._regathered: dict[str, Tensor] = {}
        self.release()

    # -- between calls -------------------------------------------------------------------
    def release(self) -> None:
        """Shard what the modules hold into the chunks and empty the modules (at the start,
        and at the first call after :meth:`gather_modules`)."""
        if not self._full:
            return
        with torch.no_grad():
            for key, sharded, unit in self.units:
                flat = unit.flatten([self.params[n].detach() for n in unit.names])
                chunk = unit.my_chunk(flat, sharded.topology.shard_rank)
                if key in self.chunks:  # the same tensor: the step's graph writes into it
                    self.chunks[key].copy_(chunk)
                else:
                    self.chunks[key] = chunk.clone()
                for n in unit.names:
                    self.params[n].data = torch.empty(0, dtype=unit.dtype, device=unit.device)
        self._full = False

    @property
    def holds_whole(self) -> bool:
        """Whether the modules hold the whole parameters (after :meth:`gather_modules`, until
        the next call or :meth:`release`)."""
        return self._full

    def gather_modules(self) -> None:
        """Put the whole parameters back into the modules (a collective call: every rank
        makes it). The next call of the step empties them again."""
        if self._full:
            return
        with torch.no_grad():
            for key, sharded, unit in self.units:
                flat = sharded.whole_flat(unit, self.chunks[key])
                for n, view in unit.unflatten(flat).items():
                    self.params[n].data = view
        self._full = True

    def like(self, name: str) -> Tensor:
        """A tensor of ``name``'s whole shape and dtype that holds no memory (a stand-in)."""
        if name not in self._like:
            _, unit = self.by_key[self.key_of[name]]
            shape = unit.shapes[unit.names.index(name)]
            zero = torch.zeros((), dtype=unit.dtype, device=unit.device)
            self._like[name] = zero.expand(shape)
        return self._like[name]

    def whole_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``params`` with the sharded ones as whole-shaped stand-ins (for the optimizer's
        ``load_state_dict``, which shards what it loads by their shapes)."""
        return {
            n: (torch.empty_like(self.like(n)) if n in self.names else p) for n, p in params.items()
        }

    # -- while tracing ------------------------------------------------------------------
    def gather(self, by_name: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The whole parameters, from the chunk inputs in ``by_name``: one all-gather per
        unit; each parameter a tensor of its own for the body to use as a leaf."""
        self._inputs = {key: by_name[key] for key, _, _ in self.units}
        self._updated, self._regathered = {}, {}
        leaves = {}
        for key, _, unit in self.units:
            for n, view in unit.unflatten(self._gathered(key)).items():
                leaves[n] = view.detach()
                self._initial[n] = leaves[n]._version
        self._leaf_names = {id(leaf): n for n, leaf in leaves.items()}
        return leaves

    def _gathered(self, key: str) -> Tensor:
        sharded, _ = self.by_key[key]
        chunk, group = self._inputs[key], sharded.topology.shard_group
        return chunk.clone() if group is None else all_gather(chunk, group)

    @contextlib.contextmanager
    def regathering(self) -> Iterator[None]:
        """While tracing: autograd saves a whole parameter for backward as a note, and
        backward gathers its unit again (once per unit), so that the gathered parameters
        need not live from forward to backward. Only while the parameter holds what its
        chunk does (not after an update or an in-place write), and only for a first-order
        backward: one with ``create_graph=True`` differentiates through the saved tensor."""

        def pack(t: Tensor) -> Any:
            base = t if t._base is None else t._base
            name = self._leaf_names.get(id(base))
            if name is None or base._version != self._initial[name]:
                return t
            return (_REGATHER, name, t.size(), t.stride(), t.storage_offset(), t)

        def unpack(packed: Any) -> Tensor:
            if not (isinstance(packed, tuple) and packed and packed[0] is _REGATHER):
                return packed
            _, name, size, stride, offset, saved = packed
            if torch.is_grad_enabled():  # create_graph=True: the saved tensor's history
                return saved
            key = self.key_of[name]
            if key not in self._regathered:
                self._regathered[key] = self._gathered(key)
            return self._regathered[key].as_strided(size, stride, offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def segment(self, sharded: Sharded, name: str, whole: Tensor) -> Tensor | None:
        """This rank's segment of ``name`` read from its chunk input while the body has not
        written the parameter (``whole``), so the update needs no whole parameter."""
        if whole._version != self._initial.get(name):
            return None
        seg = sharded.segment_of[name]
        return self._inputs[self.key_of[name]][seg.start : seg.stop]

    def updated(self, sharded: Sharded, unit: FlatUnit, chunk: Tensor) -> None:
        """An optimizer's update made ``chunk``, this rank's chunk of ``unit``."""
        key = next(k for k, s, u in self.units if u is unit and s is sharded)
        self._updated[key] = (chunk, None)

    def written(self, leaves: Mapping[str, Tensor]) -> None:
        """The update was written into the whole parameters: their versions now."""
        for key, (chunk, versions) in list(self._updated.items()):
            if versions is None:
                _, unit = self.by_key[key]
                self._updated[key] = (chunk, [leaves[n]._version for n in unit.names])

    def leave(self, leaves: Mapping[str, Tensor]) -> None:
        """At the end of the body: each chunk input takes this rank's chunk of the new
        parameters (the update's own where the body wrote nothing after it)."""
        with torch.no_grad():
            for key, sharded, unit in self.units:
                versions = [leaves[n]._version for n in unit.names]
                if versions == [self._initial[n] for n in unit.names]:
                    continue
                chunk, after = self._updated.get(key, (None, None))
                if chunk is None or versions != after:
                    flat = unit.flatten([leaves[n].detach() for n in unit.names])
                    chunk = unit.my_chunk(flat, sharded.topology.shard_rank)
                self._inputs[key].copy_(chunk)
        # Nothing of this trace outlives it.
        self._inputs, self._updated, self._regathered, self._leaf_names = {}, {}, {}, {}


def check_zero3_optimizers(optimizers: Sequence[Any]) -> None:
    """ZeRO-3 under jit shards the state of functacc's twins (SGD, Adam, AdamW) and of
    ``functacc.optim`` transformations."""
    from ..core.own_step import OwnStepLink

    for linked in optimizers:
        if isinstance(linked, OwnStepLink):
            raise ValueError(
                f"parallel=ZeRO(3) with {linked.label} "
                f"({type(linked.optimizer).__name__}), which the step traces through its own "
                "step(): ZeRO-3 shards the parameters of torch.optim.SGD, Adam, AdamW and "
                "functacc.optim transformations (as_optimizer). Use "
                "ZeRO(1) or ZeRO(2) for this optimizer (each rank then owns whole parameters)."
            )
