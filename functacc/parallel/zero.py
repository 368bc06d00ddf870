"""ZeRO (Rajbhandari et al., 2020) stages 1-3 as transforms of the traced step.

The parameters of each *wrap unit* (a module whose class is in ``wrap_layer_cls``, or the
rest of the model) and optimizer param group are flattened into one padded vector; rank r of
a shard group of n ranks owns the r-th of its n equal chunks.

- stage 1: the optimizer state is sharded: gradients are all-reduced, each rank updates its
  chunk, the chunks are all-gathered into the new parameters.
- stage 2: as stage 1, but gradients are reduce-scattered (each rank receives only its chunk).
- stage 3 (:mod:`.zero3_jit`): the parameters are sharded too, kept as chunks between
  calls. Each unit is all-gathered inside the step just before its first use and again in
  backward (a saved-tensor hook re-gathers instead of keeping the full weights alive), so
  the full weights live only while used; gradients and optimizer state are sharded as in
  stage 2.

With ``shard_size`` < world size (hybrid), chunks are sharded within groups of
``shard_size`` ranks and the chunk gradients all-reduced across the groups.

The optimizer works on *segments*: the part of each parameter inside this rank's chunk
(possibly empty), keyed by the parameter's name, with the parameter's own step count. So a
parameter that gets no gradient (unused in forward, or frozen with ``requires_grad_(False)``)
is skipped exactly as ``torch.optim`` skips a ``.grad`` of ``None``: no weight decay, no
moment update, no step count, while the rest of its unit trains.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.functional import check_module_classes
from .comm import all_gather, all_reduce, average_written, reduce_scatter
from .flat import FlatUnit, Segment
from .mesh import Topology
from .strategy import Strategy
from .zero_state import ShardedOptimizerState

__all__ = ["Sharded", "ZeRO"]


@dataclass(frozen=True)
class ZeRO:
    """Shard optimizer state (stage 1), gradients (2) and parameters (3) over the ranks.

    Example:
        >>> import functacc
        >>> zero3 = functacc.parallel.ZeRO(3, wrap_layer_cls={"Bottleneck"})
        >>> hybrid = functacc.parallel.ZeRO(2, shard_size=8)  # shard in 8s, replicate across
    """

    stage: int
    """1: optimizer state; 2: also gradients; 3: also parameters."""
    _: KW_ONLY
    shard_size: int | None = None
    """Ranks per shard group (None: all ranks). Must divide the world size."""
    wrap_layer_cls: Collection[str] | None = None
    """Class names of the modules whose parameters form one unit (gathered together in stage
    3), e.g. ``{"Bottleneck"}`` or ``{"TransformerEncoderLayer"}``; the rest is one unit."""
    bucket_mb: float = 25.0
    """Bucket size for the all-reduces of buffers and of unsharded parameters' gradients."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3; got {self.stage!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0; got {self.bucket_mb}")
        if isinstance(self.wrap_layer_cls, str):
            object.__setattr__(self, "wrap_layer_cls", {self.wrap_layer_cls})

    def build(
        self,
        model: nn.Module,
        groups: Sequence[Sequence[str]] | None,
        topology: Topology | None = None,
    ) -> Sharded:
        """The strategy over all ranks, or over ``topology`` (tensor parallelism's
        data-parallel axis)."""
        if topology is None:
            device_type = next((p.device.type for p in model.parameters()), "cpu")
            topology = Topology.build(self.shard_size, device_type=device_type)
        return Sharded(self, topology, model, groups)


def _wrap_modules(model: nn.Module, classes: Collection[str] | None) -> list[str]:
    """Qualified names of the outermost modules whose class is in ``classes``."""
    if not classes:
        return []
    check_module_classes(model, classes, "wrap_layer_cls")
    out: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(
            name.startswith(prefix + ".") for prefix in out
        ):
            out.append(name)
    return out


class Sharded(ShardedOptimizerState, Strategy):
    """The ZeRO strategy built by :class:`ZeRO` (stages 1 and 2; jit's ZeRO-3 shards its
    gradients and optimizer state with stage 2's, :func:`~.zero3_jit.as_stage2`)."""

    def __init__(
        self,
        config: ZeRO,
        topology: Topology,
        model: nn.Module,
        groups: Sequence[Sequence[str]] | None,
    ):
        self.config = config
        self.stage = config.stage
        self.topology = topology
        self.name = f"ZeRO-{config.stage}" + (
            f" (hybrid: {topology.replicas} x {topology.shard_size})"
            if topology.replicas > 1
            else ""
        )
        self.bucket_bytes = config.bucket_mb * 2**20
        params = dict(model.named_parameters())
        self._param_objects = params
        if groups is None:  # a GradientTransformation: every trainable parameter
            groups = [[n for n, p in params.items() if p.requires_grad]]
        group_of = {n: i for i, g in enumerate(groups) for n in g}
        wraps = _wrap_modules(model, config.wrap_layer_cls)
        self.units: list[FlatUnit] = []
        by_key: dict[tuple, FlatUnit] = {}
        for name, p in params.items():
            if name not in group_of:
                continue  # not optimised: stays whole on every rank
            module = next((w for w in wraps if name.startswith(w + ".")), "")
            unit_key = (module, group_of[name], p.dtype, p.device)
            if unit_key not in by_key:
                label = f"{module or '<root>'}[group {group_of[name]}]"
                if any(k[:2] == unit_key[:2] for k in by_key):
                    label += f"[{p.dtype}]"
                by_key[unit_key] = FlatUnit(
                    label,
                    module,
                    group_of[name],
                    [],
                    [],
                    p.dtype,
                    p.device,
                    topology.shard_size,
                )
                self.units.append(by_key[unit_key])
            by_key[unit_key].names.append(name)
            by_key[unit_key].shapes.append(p.shape)
            by_key[unit_key].__post_init__()
        self.sharded_names = {n for u in self.units for n in u.names}
        self.unit_of = {n: u for u in self.units for n in u.names}
        self.segment_of: dict[str, Segment] = {
            n: seg for u in self.units for n, seg in u.segments(topology.shard_rank).items()
        }

    # -- construction (eager) ------------------------------------------------------------
    def whole_flat(self, unit: FlatUnit, chunk: Tensor) -> Tensor:
        """Every rank's chunk of ``unit`` (this rank's: ``chunk``) gathered into the unit's
        flat vector, eagerly (a collective call: every rank of the shard group makes it)."""
        flat = chunk.new_empty(unit.chunk * unit.shard_size)
        if self.topology.shard_group is None:
            flat.copy_(chunk)
        else:
            dist.all_gather_into_tensor(flat, chunk.contiguous(), self.topology.shard_group)
        return flat

    # -- inside the traced step ----------------------------------------------------------
    def optimizer_params(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for name, seg in self.segment_of.items():
            out[name] = params[name].reshape(-1)[seg.offset : seg.offset + seg.numel]
        return out

    def reduce_gradients(
        self, grads: dict[str, Tensor], extra: dict[str, Any], signature: tuple
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        topo, world = self.topology, self.topology.world
        out = {}
        for unit in self.units:
            present = [n for n in unit.names if n in grads]
            if not present:
                continue
            flat = (
                unit.flatten(
                    [
                        grads[n] if n in grads else grads[present[0]].new_zeros(s)
                        for n, s in zip(unit.names, unit.shapes, strict=True)
                    ]
                )
                / world
            )
            if self.stage == 1:
                chunk = unit.my_chunk(all_reduce(flat, topo.data_group), topo.shard_rank)
            else:
                chunk = reduce_scatter(flat, topo.shard_group)
            if topo.replicate_group is not None and self.stage != 1:
                chunk = all_reduce(chunk, topo.replicate_group)
            # Only the parameters that got a gradient are updated (torch.optim skips a
            # .grad of None); the unit's chunk still travels whole.
            for name in present:
                seg = self.segment_of[name]
                out[name] = chunk[seg.start : seg.stop]
        return out, extra

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return average_written(
            buffers,
            self.topology.data_group,
            world=self.topology.world,
            bucket_bytes=self.bucket_bytes,
        )

    def new_params(
        self, updated: Mapping[str, Tensor], params: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        new = dict(params)
        old = self.optimizer_params(params)
        for unit in self.units:
            if not any(n in updated for n in unit.names):
                continue
            pieces = [updated.get(n, old[n]) for n in unit.names]
            new.update(self.gather_unit(unit, pieces))
        return new

    def chunk_of(self, unit: FlatUnit, pieces: Sequence[Tensor]) -> Tensor:
        """This rank's chunk of ``unit`` from its segments (one per name, in the unit's
        order); the padding is zero."""
        pad = unit.chunk - unit.covered(self.topology.shard_rank)
        return torch.cat([*pieces, pieces[0].new_zeros(pad)] if pad else list(pieces))

    def gather_unit(self, unit: FlatUnit, pieces: Sequence[Tensor]) -> dict[str, Tensor]:
        """Every rank's segments of ``unit`` (this rank's: ``pieces``), all-gathered into
        whole tensors by name (views of one gathered vector)."""
        flat = self.chunk_of(unit, pieces)
        if self.topology.shard_group is not None:
            flat = all_gather(flat, self.topology.shard_group)
        return unit.unflatten(flat)
