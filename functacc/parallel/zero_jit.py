"""ZeRO stages 1 and 2 for :func:`functacc.jit`: each rank keeps and updates a shard of the
state of each ``torch.optim`` optimizer the step body calls.

Under ``jit(..., parallel=ZeRO(1))`` every ``backward()`` still averages the gradients whole
over the ranks, as data parallelism does, so the body reads ``p.grad`` as under DDP (a
gradient penalty, clipping, SAM's ascent step). Each ``opt.step()`` then updates only this
rank's chunk of each flat unit of the optimizer's parameters (:mod:`.flat`), from that chunk
of the gradient and of the state, and all-gathers the chunks into the new parameters: each
rank holds 1/world of Adam's moments. Under ``ZeRO(2)`` each ``backward()`` reduce-scatters
those parameters' gradients instead, so that each rank receives only its chunk
(:class:`~.jit_grads.ShardedGradients`): a body that reads ``p.grad`` whole still can (the
chunks are gathered for that read), and ``.grad`` is ``None`` after the call.

``optimizer.state_dict()`` gathers the state whole (a collective call: every rank makes it)
and ``load_state_dict()`` shards what it loads, as under :func:`functacc.compile_step`'s
ZeRO; between those calls ``optimizer.state`` is empty.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from .zero import Sharded, ZeRO

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    """The ZeRO-1/2 layout of one optimizer's parameters: ``groups`` are its param groups,
    by the names the parameters have in ``holder`` (the jitted step's modules).

    Example:
        >>> import torch, functacc
        >>> holder = torch.nn.ModuleDict({"model": torch.nn.Linear(4, 3)})
        >>> shards = ShardedOptimizer(functacc.parallel.ZeRO(1), holder, [["model.weight"]])
        >>> shards.segments({"model.weight": holder["model"].weight})["model.weight"].shape
        torch.Size([12])
    """

    def __init__(
        self,
        config: ZeRO,
        holder: nn.Module,
        groups: Sequence[Sequence[str]],
        topology: Any = None,
    ):
        self.check(config)
        self.sharded: Sharded = config.build(holder, [list(g) for g in groups], topology)
        self.gradients: Any = None  # ZeRO-2: the step's jit_grads.ShardedGradients
        self.rest: Any = None  # ZeRO-3: the step's zero3_jit.ShardedParameters

    @staticmethod
    def check(config: ZeRO) -> None:
        """Stage 3 is not this layout's: ZeRO-3 keeps the parameters' chunks in
        :class:`~.zero3_jit.ShardedParameters` and builds this class with stage 2's."""
        if config.stage == 3:
            raise AssertionError("ShardedOptimizer takes ZeRO-3's stage-2 layout (as_stage2)")

    def grad_segments(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's part of each gradient (named as the parameters), flat: under ZeRO-2
        the reduce-scattered shard itself where the body left the gradient as it came."""
        if self.gradients is None:
            return self.segments(grads)
        return {n: self.gradients.shard_of(n, g) for n, g in grads.items()}

    def segments(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's part of each of ``tensors`` (named as the parameters), flat."""
        out = {}
        for name, tensor in tensors.items():
            seg = self.sharded.segment_of[name]
            out[name] = tensor.reshape(-1)[seg.offset : seg.offset + seg.numel]
        return out

    def param_segments(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's part of each parameter for the update: under ZeRO-3 read from the
        chunk the step started from, while the body has not written the parameter."""
        if self.rest is None:
            return self.segments(params)
        out = {}
        for name, param in params.items():
            seg = self.rest.segment(self.sharded, name, param)
            out[name] = seg if seg is not None else self.segments({name: param})[name]
        return out

    def shard_state(self, named_state: Any, transform: Any, params: Mapping[str, Tensor]) -> Any:
        """The optimizer's state for this rank's segments, from the full named state."""
        return self.sharded.shard_optimizer_state(named_state, transform, self.segments(params))

    def gather(
        self, updated: Mapping[str, Tensor], params: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The new full parameters: every rank's updated segments, all-gathered (inside the
        traced step: a collective of the graph). Under ZeRO-3 this rank's chunk of each
        updated unit is kept for the end of the step, which then needs no gathered tensor."""
        if self.rest is not None:
            old = self.param_segments(params)
            for unit in self.sharded.units:
                if any(n in updated for n in unit.names):
                    pieces = [updated.get(n, old[n]) for n in unit.names]
                    self.rest.updated(self.sharded, unit, self.sharded.chunk_of(unit, pieces))
        return self.sharded.new_params(updated, params)

    def written(self, params: Mapping[str, Tensor]) -> None:
        """The update was copied into ``params`` (the traced parameters)."""
        if self.rest is not None:
            self.rest.written(params)

    def show_whole(self, linked: Any, transform: Callable[[], Any]) -> None:
        """Make ``linked``'s ``torch.optim`` optimizer gather its state in ``state_dict()``
        and shard it in ``load_state_dict()``. ``linked`` has ``state`` (this rank's) and
        ``link``; it is held weakly, so the optimizer does not keep a dropped step alive."""
        ref = weakref.ref(linked)

        def live() -> Any:
            current = ref()
            if current is None:
                return None
            params = dict(current.link.params)
            if self.rest is not None:  # ZeRO-3: the modules hold empty placeholders
                params = self.rest.whole_params(params)
            return _Live(current.state, params)

        self.sharded.link_optimizer(linked.link, live, transform)


class _Live:
    """What :meth:`Sharded.link_optimizer` reads of a step: the optimizer state and the
    full parameters by name."""

    def __init__(self, opt_state: Any, params: dict[str, Tensor]):
        self.opt_state = opt_state
        self.params = params
