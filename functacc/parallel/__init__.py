"""Sharding the training step over ranks: explicit collective transforms of the pure step.

- :class:`DataParallel`: gradients averaged with bucketed all-reduces (optionally
  compressed to bfloat16 or with :class:`PowerSGD`).
- :class:`TensorParallel`: layers split over groups of ranks (Megatron-LM), combined with
  data parallelism across the groups (``parallel=[TensorParallel(plan), DataParallel()]``).
- :class:`ZeRO`: stage 1 shards the optimizer state, stage 2 also reduce-scatters the
  gradients, stage 3 also shards the parameters (gathered per wrap unit, just before use in
  forward and again in backward). ``shard_size`` < world size gives hybrid sharding.

The collectives are traced into the step graph (``torch.distributed``'s functional
collectives), on gloo (CPU) or NCCL (CUDA), under ``torchrun``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from .data_parallel import DataParallel
from .mesh import Topology, check_launched, init_distributed, rank, world_size
from .powersgd import PowerSGD
from .strategy import Replicated, Strategy
from .tensor_parallel import TensorParallel
from .tp_clip import clip_grad_norm_
from .tp_ops import vocab_parallel_cross_entropy
from .tp_setup import TensorParallelSetup
from .zero import ZeRO

__all__ = [
    "DataParallel",
    "PowerSGD",
    "TensorParallel",
    "Topology",
    "ZeRO",
    "clip_grad_norm_",
    "init_distributed",
    "rank",
    "resolve_strategy",
    "vocab_parallel_cross_entropy",
    "world_size",
]


def resolve_strategy(
    parallel: Any,
    model: nn.Module,
    groups: Sequence[Sequence[str]] | None,
    tensor_parallel: TensorParallelSetup | None = None,
) -> Strategy:
    """The strategy for ``compile_step(parallel=...)``; ``None`` means data parallel over
    all ranks when the world size is > 1, nothing otherwise. With ``tensor_parallel`` (the
    model split already), data parallel across its groups."""
    if tensor_parallel is not None:
        return _across_tensor_parallel(parallel, tensor_parallel, model, groups)
    if parallel is not None and not isinstance(parallel, (DataParallel, ZeRO)):
        raise TypeError(
            "parallel must be None, functacc.parallel.DataParallel(...) or "
            f"functacc.parallel.ZeRO(...); got {type(parallel).__name__}"
        )
    check_launched()
    if parallel is None:
        parallel = DataParallel()
    if world_size() == 1:
        return Strategy()
    return parallel.build(model, groups)


def _across_tensor_parallel(
    parallel: Any, setup: TensorParallelSetup, model: nn.Module, groups: Any
) -> Strategy:
    name = f"tensor parallel (size {setup.layouts[0].size})"
    if isinstance(parallel, ZeRO) and setup.replicas > 1:
        strategy = setup.zero(parallel, model, groups)
        strategy.name = f"{name} x {strategy.name} ({setup.replicas})"
        return strategy
    if not isinstance(parallel, (DataParallel, ZeRO, type(None))):
        raise TypeError(
            "beside TensorParallel, parallel takes DataParallel or ZeRO; got "
            f"{type(parallel).__name__}"
        )
    parallel = parallel if isinstance(parallel, DataParallel) else DataParallel()
    if setup.replicas == 1:
        strategy = Strategy()
    else:
        strategy = Replicated(
            setup.topology(), bucket_mb=parallel.bucket_mb, compression=parallel.compression
        )
    strategy.tensor_parallel = setup.layouts[0]
    strategy.name = name + (f" x data parallel ({setup.replicas})" if setup.replicas > 1 else "")
    return strategy
