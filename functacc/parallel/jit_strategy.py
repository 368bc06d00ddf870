"""What a jitted step's ``backward()`` and optimizers do across ranks: the gradient
policy and optimizer sharding chosen from ``jit(..., parallel=...)``.

Data parallel and ZeRO-1 average whole gradients, ZeRO-2 reduce-scatters them into each
rank's shard, ZeRO-3 also keeps the parameters as chunks between calls; beside
:class:`~functacc.parallel.TensorParallel` the same policies run over the replicas.

Example:
    >>> import torch
    >>> from functacc.core.capture import Capture
    >>> model = torch.nn.Linear(2, 2)
    >>> capture = Capture([model], ["model"], [], [])
    >>> jit_strategy(None, capture, None) is None  # one process, no sharding
    True
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["jit_strategy"]


def jit_strategy(parallel: Any, capture: Any, tensor_parallel: Any) -> Any:
    """The gradient policy of a jitted step (``None``: plain local gradients); sets up
    the sharding of ``capture``'s optimizers (and parameters, ZeRO-3) as it goes."""
    if tensor_parallel is not None:
        return _across_tensor_parallel(parallel, capture, tensor_parallel)
    return _strategy(parallel, capture)


def _strategy(parallel: Any, capture: Any) -> Any:
    """What the step's ``backward()`` does with gradients under torchrun (``None`` on one
    process): averaged whole (data parallel, ZeRO-1) or reduce-scattered (ZeRO-2); under
    ZeRO each optimizer's state is sharded too."""
    from ..core.own_step import OwnStepLink
    from ..parallel import DataParallel, PowerSGD, ZeRO
    from ..parallel.jit_grads import (
        AveragedGradients,
        CompressedGradients,
        LocalGradients,
        ShardedGradients,
    )
    from ..parallel.mesh import check_launched, world_size
    from ..parallel.owned_params import OwnedGradients, ParameterOwners
    from ..parallel.zero_jit import ShardedOptimizer

    if parallel is not None and not isinstance(parallel, (DataParallel, ZeRO)):
        raise TypeError(
            "parallel must be None, functacc.parallel.DataParallel(...) or "
            f"functacc.parallel.ZeRO(1, 2 or 3); got {type(parallel).__name__}"
        )
    check_launched()  # torchrun's ranks without a process group would each train alone
    if isinstance(parallel, ZeRO) and parallel.stage == 3:
        return _zero3(parallel, capture)
    if world_size() == 1 or not capture.params:
        if isinstance(parallel, ZeRO) and parallel.stage == 2:
            # The gradients' lifetime is the same on one process as on several ranks.
            return LocalGradients({n for o in capture.optimizers for g in o.link.groups for n in g})
        return None
    zero = parallel if isinstance(parallel, ZeRO) else None
    parallel = DataParallel(bucket_mb=zero.bucket_mb) if zero else (parallel or DataParallel())
    replicated = _replicated(parallel, capture)
    if isinstance(parallel.compression, PowerSGD):
        return CompressedGradients(replicated, capture.params)
    if zero is None:
        return AveragedGradients(replicated)
    holder = _holder(capture)
    whole = [linked for linked in capture.optimizers if isinstance(linked, OwnStepLink)]
    twins = [linked for linked in capture.optimizers if not isinstance(linked, OwnStepLink)]
    if whole and twins and zero.stage == 2:
        raise ValueError(
            "parallel=ZeRO(2) with an optimizer traced through its own step() "
            f"({type(whole[0].optimizer).__name__}) beside SGD, Adam or AdamW in one step: "
            "their gradients are sharded two different ways. Use ZeRO(1), or one kind."
        )
    for linked in whole:  # each rank owns whole parameters (parallel/owned_params.py)
        linked.shard(ParameterOwners(linked.params))
        _own_transform(linked)
    if whole and zero.stage == 2:
        return OwnedGradients(AveragedGradients(replicated), [w.owners for w in whole])
    shards = [ShardedOptimizer(zero, holder, linked.link.groups) for linked in twins]
    for linked, sharded in zip(twins, shards, strict=True):
        linked.shard(sharded)
    if zero.stage == 2:
        return ShardedGradients(replicated, shards)
    return AveragedGradients(replicated)


def _holder(capture: Any) -> nn.ModuleDict:
    """The step's modules by label, and the optimizers' tensors no module owns, each under
    its optimizer's label: ZeRO finds every parameter by the name the step gives it
    (``opt.param_groups[0]['params'][2]``)."""
    holder = nn.ModuleDict(dict(zip(capture.labels, capture.modules, strict=True)))
    for name, p in capture.params.items():
        if id(p) in capture.loose:
            label, key = name.split(".", 1)
            if label in capture.labels:  # a module of that name: its table is the user's
                raise ValueError(f"a module and an optimizer are both named {label!r}")
            if label not in holder:
                holder[label] = nn.Module()
            holder[label]._parameters[key] = p  # a plain tensor, as the optimizer holds it
    return holder


def _own_transform(linked: Any) -> None:
    """A ``functacc.optim`` transformation (``as_optimizer``) keeps and steps the state of
    the parameters this rank owns, its global norm summed over the ranks."""
    import torch.distributed as dist

    from ..optim import TransformOptimizer

    opt = linked.optimizer
    if isinstance(opt, TransformOptimizer):
        names = {id(p): n for n, p in opt._named().items()}
        mine = [names[id(p)] for n, p in linked.params.items() if linked.owners.owns(n)]
        opt.own(mine, linked.owners.group or dist.group.WORLD)


def _replicated(parallel: Any, capture: Any) -> Any:
    """Data parallelism over all ranks, from rank 0's weights (a collective call: every
    rank builds its step at the same point of its program)."""
    from ..parallel.strategy import check_same_model, sync_from_rank0

    # compile_step's one model: named as model.named_parameters() names them.
    own = capture.door == "compile_step" and len(capture.modules) == 1

    def named(tensors: dict) -> dict:
        return {n.split(".", 1)[1]: t for n, t in tensors.items()} if own else tensors

    check_same_model(named(capture.params), "parameter")
    check_same_model(named(capture.buffers), "buffer")
    sync_from_rank0({**capture.params, **capture.buffers})
    return parallel.build(capture.modules[0], None)


def _zero3(zero: Any, capture: Any) -> Any:
    """ZeRO-3: stage 2's gradients and optimizer state, and the optimizers' parameters kept
    as this rank's chunks between calls (:mod:`functacc.parallel.zero3_jit`); on one
    process too (the same program everywhere)."""
    from ..parallel import DataParallel
    from ..parallel.jit_grads import LocalGradients, ShardedGradients
    from ..parallel.mesh import world_size
    from ..parallel.zero3_jit import ShardedParameters, as_stage2, check_zero3_optimizers
    from ..parallel.zero_jit import ShardedOptimizer

    # A functacc.optim transformation steps this rank's segments, as the twins do.
    capture.optimizers = [_segment_wise(linked) for linked in capture.optimizers]
    check_zero3_optimizers(capture.optimizers)
    several = world_size() > 1
    replicated = _replicated(DataParallel(bucket_mb=zero.bucket_mb), capture) if several else None
    holder = _holder(capture)
    shards = [
        ShardedOptimizer(as_stage2(zero), holder, linked.link.groups)
        for linked in capture.optimizers
    ]
    for linked, sharded in zip(capture.optimizers, shards, strict=True):
        linked.shard(sharded)
    capture.rest = ShardedParameters(shards, capture.params)
    if several:
        return ShardedGradients(replicated, shards)
    return LocalGradients(capture.rest.names)


def _segment_wise(linked: Any) -> Any:
    """``linked`` as ZeRO-3 updates it, on this rank's segments of flat units: a
    ``functacc.optim`` transformation (``as_optimizer``) is linked as the twins are
    (:class:`~functacc.optim._transform_link.TransformLink`); any other link as it is."""
    from ..core.optimizers import LinkedOptimizer
    from ..core.own_step import OwnStepLink
    from ..optim import TransformOptimizer
    from ..optim._transform_link import TransformLink

    if isinstance(linked, OwnStepLink) and isinstance(linked.optimizer, TransformOptimizer):
        return LinkedOptimizer(linked.optimizer, linked.names, linked.label, TransformLink)
    return linked


def _across_tensor_parallel(parallel: Any, capture: Any, setup: Any) -> Any:
    """Data parallel or ZeRO over the replicas of the tensor-parallel groups (the modules
    are split and synced already; ZeRO shards each rank's slices with the ranks holding the
    same slices in the other groups), and clipping that sees the split parameters' slices."""
    from ..core.own_step import OwnStepLink
    from ..parallel import DataParallel, ZeRO
    from ..parallel.jit_grads import AveragedGradients, ShardedGradients
    from ..parallel.strategy import Replicated
    from ..parallel.tp_clip import TensorParallelGradients
    from ..parallel.zero3_jit import ShardedParameters, as_stage2, check_zero3_optimizers
    from ..parallel.zero_jit import ShardedOptimizer

    zero = parallel if isinstance(parallel, ZeRO) else None
    if zero is not None and zero.shard_size not in (None, setup.replicas):
        # The shard group is every tensor-parallel group's rank of the same slices.
        raise ValueError(
            f"ZeRO(shard_size={zero.shard_size}) beside TensorParallel: ZeRO shards over all "
            f"{setup.replicas} tensor-parallel groups (shard_size=None); hybrid sharding "
            "within the data-parallel axis is not supported yet"
        )
    if zero is not None and zero.stage == 3:
        check_zero3_optimizers(capture.optimizers)
    parallel = DataParallel(bucket_mb=zero.bucket_mb) if zero else (parallel or DataParallel())
    if parallel.compression not in (None, "bf16"):
        raise ValueError("functacc.jit takes PowerSGD without TensorParallel; use 'bf16' there")
    inner = None
    if setup.replicas > 1:
        replicated = Replicated(
            setup.topology(), bucket_mb=parallel.bucket_mb, compression=parallel.compression
        )
        inner = AveragedGradients(replicated)
        if zero is not None:
            if any(isinstance(linked, OwnStepLink) for linked in capture.optimizers):
                raise ValueError(
                    "ZeRO beside TensorParallel shards torch.optim.SGD, Adam and AdamW in a "
                    "jitted step; an optimizer traced through its own step() takes "
                    "[TensorParallel(...), DataParallel()]"
                )
            holder = _holder(capture)
            topology = setup.topology(sharded=True)
            config = as_stage2(zero) if zero.stage == 3 else zero
            shards = [
                ShardedOptimizer(config, holder, linked.link.groups, topology)
                for linked in capture.optimizers
            ]
            for linked, sharded in zip(capture.optimizers, shards, strict=True):
                linked.shard(sharded)
            if zero.stage == 3:  # the parameters too: this rank's chunks of its slices
                capture.rest = ShardedParameters(shards, capture.params)
            if zero.stage >= 2:
                inner = ShardedGradients(replicated, shards)
    split = {
        f"{label}.{n}": layout.group
        for label, layout in zip(capture.labels, setup.layouts, strict=True)
        for n in layout.dims
        if f"{label}.{n}" in capture.params
    }
    return TensorParallelGradients(inner, split)
