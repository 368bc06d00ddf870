"""How a step's state is laid out over the ranks, and what the step communicates.

A strategy says how to combine gradients over ranks, which tensors the optimizer updates,
and how the updated tensors become the new parameters; :mod:`functacc.parallel.jit_grads`
and :mod:`functacc.parallel.zero_jit` call it while a step is traced. ``Replicated`` covers
one process and data parallelism; :mod:`functacc.parallel.zero` covers ZeRO stages 1 to 3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import average_written, bucketed_all_reduce
from .mesh import Topology

__all__ = ["Replicated", "Strategy", "check_same_model", "sync_from_rank0"]


class Strategy:
    """Every parameter whole on every rank, no communication: one process."""

    topology = Topology(1, 1, None, None)
    name = "single process"

    # -- construction (eager) ------------------------------------------------------------
    def shard_optimizer_state(self, named_state: Any, transform: Any, opt_params: dict) -> Any:
        """The optimizer state in the optimizer's space, from the named (full) state."""
        return named_state

    def init_extra(self, params: Mapping[str, Tensor]) -> dict[str, Any]:
        """State of the communication itself (PowerSGD's error feedback)."""
        return {}

    def signature(self, count: int) -> tuple:
        """What of this strategy's behaviour changes the graph (host-side, no sync)."""
        return ()

    # -- inside the traced step ----------------------------------------------------------
    def reduce_gradients(
        self, grads: dict[str, Tensor], extra: dict[str, Any], signature: tuple
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Gradients in the optimizer's space, combined over ranks; ``signature`` is what
        :meth:`signature` said for this trace."""
        return grads, extra

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return buffers

    def optimizer_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors the optimizer updates."""
        return dict(params)

    def new_params(
        self, updated: Mapping[str, Tensor], params: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The state's new parameters from the optimizer's output."""
        return {n: updated.get(n, p) for n, p in params.items()}


class Replicated(Strategy):
    """Data parallelism: whole parameters on every rank, gradients averaged by all-reduce.

    The floating-point buffers the step writes (BatchNorm running statistics) are averaged
    over the ranks at the end of every step (summed, then divided by the world size), so every
    rank holds the same model; for running means that is the statistic of the global batch.
    Buffers the step only reads are left alone.
    """

    name = "data parallel"

    def __init__(self, topology: Topology, *, bucket_mb: float, compression: Any = None):
        self.topology = topology
        self.bucket_bytes = bucket_mb * 2**20
        self.compression = compression

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.topology.replicate_group  # looked up per use: held weakly

    def init_extra(self, params: Mapping[str, Tensor]) -> dict[str, Any]:
        if hasattr(self.compression, "init"):
            return {"compression": self.compression.init(params)}
        return {}

    def signature(self, count: int) -> tuple:
        if hasattr(self.compression, "signature"):
            return self.compression.signature(count)
        return ()

    def reduce_gradients(
        self, grads: dict[str, Tensor], extra: dict[str, Any], signature: tuple
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        world = self.topology.world
        if hasattr(self.compression, "reduce"):
            grads, state = self.compression.reduce(
                grads,
                extra["compression"],
                group=self.group,
                world=world,
                bucket_bytes=self.bucket_bytes,
                signature=signature,
            )
            return grads, {**extra, "compression": state}
        wire_dtype = torch.bfloat16 if self.compression == "bf16" else None
        reduced = bucketed_all_reduce(
            grads,
            self.group,
            scale=1.0 / world,
            bucket_bytes=self.bucket_bytes,
            wire_dtype=wire_dtype,
        )
        return reduced, extra

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return average_written(
            buffers, self.group, world=self.topology.world, bucket_bytes=self.bucket_bytes
        )


def check_same_model(named: Mapping[str, Tensor], what: str) -> None:
    """Raise on every rank if the ranks' models differ in names, shapes or dtypes."""
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in named.items()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    reference = gathered[0]
    for r, theirs in enumerate(gathered):
        if theirs == reference:
            continue
        ref_map, their_map = {n: (s, d) for n, s, d in reference}, {n: (s, d) for n, s, d in theirs}
        for name in list(ref_map) + [n for n in their_map if n not in ref_map]:
            if ref_map.get(name) != their_map.get(name):
                raise ValueError(
                    f"the model differs between ranks: {what} {name!r} is "
                    f"{_describe(ref_map.get(name))} on rank 0 but "
                    f"{_describe(their_map.get(name))} on rank {r}. Every rank must build the "
                    "same model (same constructor "
                    "arguments, same vocabulary size, ...)."
                )


def _describe(entry: tuple | None) -> str:
    return "missing" if entry is None else f"shape {entry[0]} {entry[1]}"


@torch.no_grad()
def sync_from_rank0(tensors: Mapping[str, Tensor]) -> None:
    """Broadcast every tensor from rank 0 in place, so ranks that initialised differently
    (different seeds) start from the same model."""
    for t in tensors.values():
        dist.broadcast(t, src=0)
