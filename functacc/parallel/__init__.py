"""Sharding the training step over ranks: explicit collective transforms of the traced step.

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

from .data_parallel import DataParallel
from .mesh import Topology, init_distributed, rank, world_size
from .powersgd import PowerSGD
from .tensor_parallel import TensorParallel
from .tp_clip import clip_grad_norm_
from .tp_ops import vocab_parallel_cross_entropy
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
    "vocab_parallel_cross_entropy",
    "world_size",
]
