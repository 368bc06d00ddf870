"""Sharding the training step over ranks: explicit collective transforms of the pure step.

- :class:`DataParallel`: gradients averaged with bucketed all-reduces (optionally
  compressed to bfloat16 or with :class:`PowerSGD`).
- :class:`ZeRO`: stage 1 shards the optimizer state, stage 2 also reduce-scatters the
  gradients, stage 3 also shards the parameters (gathered per wrap unit, just before use in
  forward and again in backward). ``shard_size`` < world size gives hybrid sharding.

The collectives are traced into the step graph (``torch.distributed``'s functional
collectives), on gloo (CPU) or NCCL (CUDA), under ``torchrun``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from .data_parallel import DataParallel
from .mesh import Topology, init_distributed, rank, world_size
from .powersgd import PowerSGD
from .strategy import Strategy
from .zero import ZeRO

__all__ = [
    "DataParallel",
    "PowerSGD",
    "Topology",
    "ZeRO",
    "init_distributed",
    "rank",
    "resolve_strategy",
    "world_size",
]


def resolve_strategy(
    parallel: Any, model: nn.Module, groups: Sequence[Sequence[str]] | None
) -> Strategy:
    """The strategy for ``compile_step(parallel=...)``; ``None`` means data parallel over
    all ranks when the world size is > 1, nothing otherwise."""
    if parallel is not None and not isinstance(parallel, (DataParallel, ZeRO)):
        raise TypeError(
            "parallel must be None, functacc.parallel.DataParallel(...) or "
            f"functacc.parallel.ZeRO(...); got {type(parallel).__name__}"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and world_size() == 1:
        raise RuntimeError(
            f"this process was launched as one of {launched} ranks (WORLD_SIZE={launched}) "
            "but the process group is not initialised, so each rank would train alone. Call "
            "functacc.init_distributed() before compile_step()."
        )
    if parallel is None:
        parallel = DataParallel()
    if world_size() == 1:
        return Strategy()
    return parallel.build(model, groups)
