"""How a step's state is laid out over the ranks, and what the step communicates.

A strategy is a set of pure transforms of the step function: the step asks it which tensors
to differentiate, how to turn them into the model's parameters for the forward pass, how to
combine gradients over ranks, which tensors the optimizer updates, and how the updated
tensors become the new state. ``Replicated`` covers one process and data parallelism;
:mod:`functacc.parallel.zero` covers ZeRO stages 1 to 3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..optim import global_norm
from .comm import average_written, bucketed_all_reduce
from .mesh import Topology

__all__ = ["Replicated", "Strategy", "check_same_model", "sync_from_rank0"]


class Strategy:
    """Every parameter whole on every rank, no communication: one process."""

    topology = Topology(1, 1, None, None)
    name = "single process"
    named_state = True  # the optimizer updates the named parameters themselves (no shards)
    tensor_parallel: Any = None  # the split model's TensorParallelLayout, if any

    # -- construction (eager) ------------------------------------------------------------
    def live_params(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The state's parameters, given the model's (the stateful form trains these)."""
        return params

    def state_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The state's parameters built from full, named ones (copies for the pure form)."""
        return {n: p.detach().clone() for n, p in params.items()}

    def full_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Full, named parameters from the state's (gathers where sharded)."""
        return dict(params)

    def write_model_params(self, params: Mapping[str, Tensor], model_params: dict) -> None:
        """Make the model's parameters hold the full values of the state's (sync_model)."""
        with torch.no_grad():
            for name, value in self.full_params(params).items():
                if model_params[name] is not value:
                    model_params[name].data = value.detach().clone()

    @property
    def model_synced(self) -> bool:
        """Whether the model's parameters hold the full values (after ``sync_model``)."""
        return True

    def release_model_params(self, model_params: Mapping[str, Tensor]) -> None:
        """Drop the model's full copies made by :meth:`write_model_params` where the state
        holds shards (ZeRO-3), before the next step runs."""

    def load_full_params(self, model_params: Mapping[str, Tensor], live: dict) -> None:
        """Copy full parameters (the model's) into the live state where it differs."""
        with torch.no_grad():
            for name, p in model_params.items():
                if name in live and live[name] is not p:
                    live[name].copy_(p)

    def shard_optimizer_state(self, named_state: Any, transform: Any, opt_params: dict) -> Any:
        """The optimizer state in the optimizer's space, from the named (full) state."""
        return named_state

    def optimizer_groups(self, groups: list[list[str]]) -> list[list[str]]:
        """The optimizer's parameter groups in the optimizer's own names."""
        return groups

    def init_extra(self, params: Mapping[str, Tensor]) -> dict[str, Any]:
        """State of the communication itself (PowerSGD's error feedback)."""
        return {}

    def signature(self, count: int) -> tuple:
        """What of this strategy's behaviour changes the graph (host-side, no sync)."""
        return ()

    # -- inside the traced step ----------------------------------------------------------
    def differentiable(self, params: Mapping[str, Tensor], trainable: set[str]) -> list[str]:
        """Names in ``params`` to take gradients with respect to."""
        return [n for n in params if n in trainable]

    @contextlib.contextmanager
    def materialize(self, params: dict[str, Tensor], model: nn.Module) -> Iterator[dict]:
        """The named parameters the forward pass runs with (ZeRO-3 gathers them lazily)."""
        yield params

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

    def global_norm(self, grads: Mapping[str, Tensor]) -> Tensor:
        """The norm of the whole gradient, for clipping."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel.global_norm(grads)
        return global_norm(dict(grads))

    def any_rank(self, flag: Tensor) -> Tensor:
        """``flag`` or'ed over the ranks whose gradients differ (shards), so all agree."""
        return flag

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
