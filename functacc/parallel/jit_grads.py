"""What a jitted step's ``backward()`` does with gradients over the ranks (:func:`functacc.jit`).

While a step body is traced under ``torchrun``, each ``backward()`` it calls runs autograd
and then hands the gradients it produced (this call's contribution only; ``.grad`` that was
there before is added afterwards, and ``torch.autograd.grad`` is left alone, as under DDP)
to a policy:

- :class:`AveragedGradients` (data parallel, ZeRO-1): averaged whole with bucketed
  all-reduces, started as soon as their gradients exist; ``.grad`` is the mean over the
  ranks, as DDP leaves it.
- :class:`ShardedGradients` (ZeRO-2): the gradients of the parameters a ZeRO optimizer
  shards are reduce-scattered, so each rank receives the mean of its own chunk, which is
  what its optimizer updates. Where the body reads such a ``.grad`` whole (a norm,
  clipping, SAM's ascent step), the chunks are all-gathered for that read; a gather nobody
  reads is dropped from the graph (:func:`functacc.core.graph_passes.drop_unread_ops`).
  These gradients do not outlive the call (that is the memory stage 2 saves): after it,
  their ``.grad`` is ``None``.
- :class:`LocalGradients` (ZeRO-2 on one process): the same ``.grad`` rule, nothing to
  reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

__all__ = ["AveragedGradients", "CompressedGradients", "LocalGradients", "ShardedGradients"]


class AveragedGradients:
    """Data parallelism's gradients: each ``backward()``'s averaged whole over the ranks.

    ``replicated`` is the data-parallel strategy (:class:`~.strategy.Replicated`) whose
    bucketed all-reduce averages them and which averages written buffers.
    """

    transient: frozenset[str] = frozenset()
    """Parameters whose gradients do not outlive a call (none here)."""

    def __init__(self, replicated: Any):
        self.replicated = replicated

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.replicated.sync_buffers(buffers)

    def after_backward(
        self, before: Mapping[str, Tensor | None], fresh: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        """The new ``.grad`` of each of ``before``'s parameters: what was there plus the
        average over the ranks of what this backward produced (``fresh``)."""
        reduced, _ = self.replicated.reduce_gradients(dict(fresh), {}, ())
        return {n: _add(old, reduced.get(n)) for n, old in before.items()}

    @contextlib.contextmanager
    def reducing_backward(
        self, leaves: Mapping[str, Tensor], carried: Mapping[str, Tensor] | None = None
    ) -> Iterator[None]:
        """While tracing: every ``backward()`` hands what it produces for ``leaves`` (the
        traced parameters, by name) to :meth:`after_backward` before anything can read it.
        ``carried``: the traced inputs of :attr:`carried` (the communication's own state)."""
        original = torch.autograd.backward
        self.reset()
        if carried:  # (OwnedGradients borrows this method: it carries nothing)
            self.carry(carried)

        def backward(*args: Any, **kwargs: Any) -> None:
            trainable = {n: leaf for n, leaf in leaves.items() if leaf.requires_grad}
            before = {n: leaf.grad for n, leaf in trainable.items()}
            for leaf in trainable.values():
                leaf.grad = None
            try:
                original(*args, **kwargs)
            except BaseException:
                for n, leaf in trainable.items():
                    leaf.grad = before[n]
                raise
            fresh = {n: leaf.grad for n, leaf in trainable.items() if leaf.grad is not None}
            for n, grad in self.after_backward(before, fresh).items():
                trainable[n].grad = grad

        torch.autograd.backward = backward
        try:
            yield
        finally:
            torch.autograd.backward = original

    def reset(self) -> None:
        """A new trace starts."""

    def carry(self, traced: Mapping[str, Tensor]) -> None:
        """A new trace starts with ``traced`` standing for :attr:`carried` (none here)."""


class CompressedGradients(AveragedGradients):
    """Data parallelism with PowerSGD (:class:`~.powersgd.PowerSGD`): each ``backward()``
    sends the gradients it adds as low-rank factors, warm-started from the last factors,
    and keeps what they miss as error feedback for the next ``backward()``. Factors and
    errors are :attr:`carried` from call to call as inputs the graph writes; the first
    ``warmup_steps`` calls all-reduce the gradients whole (then the step traces again).

    Example:
        >>> import torch, functacc
        >>> from functacc.parallel.strategy import Replicated
        >>> from functacc.parallel.mesh import Topology
        >>> psgd = functacc.parallel.PowerSGD(rank=2)
        >>> dp = Replicated(Topology(1, 1, None, None), bucket_mb=25, compression=psgd)
        >>> policy = CompressedGradients(dp, {"w": torch.nn.Parameter(torch.ones(16, 16))})
        >>> sorted(policy.carried)
        ["['compression']['error']['w']", "['compression']['q']['w']"]
    """

    def __init__(self, replicated: Any, params: Mapping[str, Tensor]):
        super().__init__(replicated)
        flat, self._spec = pytree.tree_flatten_with_path(replicated.init_extra(params))
        self.carried: dict[str, Tensor] = {pytree.keystr(path): t for path, t in flat}
        self.calls = 0  # successful calls: the warm-up counts them
        self._traced: Any = None
        self._signature: tuple = ()

    def signature(self) -> tuple:
        """What of the communication changes the graph now (warm-up or compressing)."""
        return self.replicated.signature(self.calls)

    def called(self) -> None:
        self.calls += 1

    def carry(self, traced: Mapping[str, Tensor]) -> None:
        self._traced = pytree.tree_unflatten([traced[k] for k in self.carried], self._spec)
        self._signature = self.signature()

    def after_backward(
        self, before: Mapping[str, Tensor | None], fresh: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        reduced, self._traced = self.replicated.reduce_gradients(
            dict(fresh), self._traced, self._signature
        )
        return {n: _add(old, reduced.get(n)) for n, old in before.items()}

    def carried_out(self) -> dict[str, Tensor]:
        """At the end of the trace: the factors and errors for the next call."""
        return dict(zip(self.carried, pytree.tree_leaves(self._traced), strict=True))


class ShardedGradients(AveragedGradients):
    """ZeRO-2's gradients: reduce-scattered by unit for the parameters that ``optimizers``
    (:class:`~.zero_jit.ShardedOptimizer`, one per ``torch.optim`` optimizer of the step)
    shard; averaged whole, as :class:`AveragedGradients`, for the others.

    Example:
        >>> import torch, functacc
        >>> from functacc.parallel.strategy import Replicated
        >>> from functacc.parallel.zero_jit import ShardedOptimizer
        >>> holder = torch.nn.ModuleDict({"model": torch.nn.Linear(4, 3)})
        >>> names = [["model.weight", "model.bias"]]
        >>> shards = ShardedOptimizer(functacc.parallel.ZeRO(2), holder, names)
        >>> policy = ShardedGradients(Replicated(shards.sharded.topology, bucket_mb=25), [shards])
        >>> sorted(policy.transient)
        ['model.bias', 'model.weight']
    """

    def __init__(self, replicated: Any, optimizers: Sequence[Any]):
        super().__init__(replicated)
        self.owners = [o.sharded for o in optimizers]
        self.owner_of = {n: owner for owner in self.owners for n in owner.sharded_names}
        self.transient = frozenset(self.owner_of)
        for o in optimizers:
            o.gradients = self
        # While tracing: each whole .grad this policy made -> (it, its version, its shard),
        # so that the optimizer updates from the shard itself while the body has not changed
        # the gradient, and the gather stays unread.
        self._made: dict[int, tuple[Tensor, int, Tensor]] = {}

    def reset(self) -> None:
        self._made = {}

    def after_backward(
        self, before: Mapping[str, Tensor | None], fresh: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        others = {n: g for n, g in before.items() if n not in self.owner_of}
        whole = {n: g for n, g in fresh.items() if n not in self.owner_of}
        out = super().after_backward(others, whole)
        out.update({n: g for n, g in before.items() if n in self.owner_of})
        for owner in self.owners:
            mine = {n: g for n, g in fresh.items() if self.owner_of.get(n) is owner}
            if not mine:
                continue
            added, _ = owner.reduce_gradients(mine, {}, ())  # this rank's segments, averaged
            for unit in owner.units:
                if not any(n in added for n in unit.names):
                    continue
                like = next(added[n] for n in unit.names if n in added)
                shards, pieces = {}, []
                for n in unit.names:
                    if n in added:
                        old = before.get(n)
                        shards[n] = added[n] if old is None else self.shard_of(n, old) + added[n]
                    # Other names' part of the gather is not read: zeros do.
                    pieces.append(shards.get(n, like.new_zeros(owner.segment_of[n].numel)))
                gathered = owner.gather_unit(unit, pieces)
                for n, shard in shards.items():
                    out[n] = gathered[n]
                    self._made[id(gathered[n])] = (gathered[n], gathered[n]._version, shard)
        return out

    def shard_of(self, name: str, grad: Tensor) -> Tensor:
        """This rank's segment of ``name``'s gradient ``grad``: the reduce-scattered shard
        itself where ``grad`` is the untouched gather of it, else a slice of ``grad``."""
        made = self._made.get(id(grad))
        if made is not None and made[0] is grad and grad._version == made[1]:
            return made[2]
        seg = self.owner_of[name].segment_of[name]
        return grad.reshape(-1)[seg.offset : seg.offset + seg.numel]


class LocalGradients(AveragedGradients):
    """ZeRO-2 on one process: nothing to reduce, but the gradients of the ``transient``
    parameters (those the optimizers update) do not outlive the call either, so that a
    body behaves on one process as under torchrun.

    Example:
        >>> policy = LocalGradients({"model.weight"})
        >>> sorted(policy.transient), policy.sync_buffers({}) == {}
        (['model.weight'], True)
    """

    def __init__(self, transient: Collection[str]):
        super().__init__(None)
        self.transient = frozenset(transient)

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return buffers

    def after_backward(
        self, before: Mapping[str, Tensor | None], fresh: Mapping[str, Tensor]
    ) -> dict[str, Tensor | None]:
        return {n: _add(old, fresh.get(n)) for n, old in before.items()}


def _add(old: Tensor | None, new: Tensor | None) -> Tensor | None:
    if new is None:
        return old
    return new if old is None else old + new
