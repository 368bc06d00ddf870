"""Tensor parallelism at a front door: the 2-D mesh, the split, and what is left to the
other strategy (``parallel=[TensorParallel(plan, size=2), DataParallel()]``).

Ranks form a ``(replicas, size)`` grid, tensor parallel along the inner dimension
(consecutive ranks: one node's processes under torchrun), data parallel along the outer one.
Before the split, every rank takes rank 0's whole model, so the replicas' slices agree;
afterwards the other strategy works on the slices over the data-parallel group only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..optim import TransformOptimizer
from .mesh import GroupRef, Topology, check_launched, world_size
from .strategy import check_same_model, sync_from_rank0
from .tensor_parallel import TensorParallel, TensorParallelLayout

__all__ = ["TensorParallelSetup", "split_parallel"]


# Optimizers whose update reads a norm or factors of a whole parameter (known by class name:
# torch's, timm's, lion-pytorch's and others'); elementwise ones work on slices as on wholes.
WHOLE_TENSOR_OPTIMIZERS = frozenset(
    {"Lamb", "LAMB", "Lars", "LARS", "Adafactor", "AdafactorBigVision", "NvNovoGrad",
     "NovoGrad", "Shampoo", "Muon", "Came"}
)  # fmt: skip


def split_parallel(parallel: Any) -> tuple[TensorParallel | None, Any]:
    """``(tensor parallel, the other strategy)`` of a front door's ``parallel=``: one
    object, or a list of a :class:`TensorParallel` and at most one other.

    Example:
        >>> import functacc
        >>> tp = functacc.parallel.TensorParallel({"fc": "colwise"})
        >>> split_parallel([tp, None]) == (tp, None), split_parallel(None)
        (True, (None, None))
    """
    if not isinstance(parallel, (list, tuple)):
        parallel = [parallel]
    tps = [p for p in parallel if isinstance(p, TensorParallel)]
    others = [p for p in parallel if p is not None and not isinstance(p, TensorParallel)]
    if len(tps) > 1 or len(others) > 1:
        raise ValueError(
            "parallel takes one strategy, or a list of one TensorParallel and one "
            "DataParallel or ZeRO (the mesh's two dimensions); got "
            f"{[type(p).__name__ for p in parallel]}"
        )
    return (tps[0] if tps else None), (others[0] if others else None)


@dataclass
class TensorParallelSetup:
    """The split models' layouts and the data-parallel group across tensor-parallel groups
    (``None`` and size 1 when every rank is in one tensor-parallel group)."""

    layouts: list[TensorParallelLayout]
    replicas: int
    replicate: GroupRef | None

    @classmethod
    def build(
        cls,
        tp: TensorParallel,
        modules: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> TensorParallelSetup:
        """Split ``modules`` in place (a collective call: every rank makes it)."""
        for opt in optimizers:
            if type(opt).__name__ in WHOLE_TENSOR_OPTIMIZERS:
                raise ValueError(
                    f"TensorParallel: {type(opt).__name__} scales each parameter's update by "
                    "a norm of the whole tensor, which a rank holding a slice would compute "
                    "from its slice alone (a different update per rank). Use an elementwise "
                    "optimizer (SGD, Adam, AdamW, RMSprop, Lion, ...) with TensorParallel"
                )
            if isinstance(opt, TransformOptimizer) and not opt.stepped:
                continue  # its state is the transformation's init: made again after the split
            if isinstance(opt, TransformOptimizer) or opt.state:
                raise ValueError(
                    f"TensorParallel: the {type(opt).__name__} has state already (it has "
                    "stepped); its state is of the whole parameters. Build the step (and the "
                    "split) before the first optimizer step, or a new optimizer"
                )
        check_launched()
        world = world_size()
        size = world if tp.size is None else tp.size
        if world % size:
            raise ValueError(
                f"TensorParallel(size={size}) needs a world size it divides; the world size "
                f"is {world}. Launch a multiple of {size} processes (torchrun "
                f"--nproc_per_node={size}), or pick a divisor of {world}"
            )
        tensors = {f"{i}.{n}": t for i, m in enumerate(modules) for n, t in m.state_dict().items()}
        if world > 1:  # each replica's slices from the same whole model
            check_same_model(tensors, "parameter or buffer")
            sync_from_rank0(tensors)
        tp_group, dp_group = _groups(world, size, modules)
        layouts = tp.split(list(modules), tp_group)
        split = {
            id(m.get_parameter(n))
            for m, layout in zip(modules, layouts, strict=True)
            for n in layout.dims
        }
        for opt in optimizers:
            if isinstance(opt, TransformOptimizer):
                opt.rebuild_state()  # over the slices this rank now holds
                # clip_by_global_norm: the slices' squares summed over the group
                opt.split_over([n for n, p in opt._named().items() if id(p) in split], tp_group)
        return cls(layouts, world // size, GroupRef(dp_group) if dp_group is not None else None)

    def topology(self, sharded: bool = False) -> Topology:
        """The data-parallel axis as a :class:`Topology`: whole replicas, or (``sharded``)
        one shard group of all of them (ZeRO across the tensor-parallel groups)."""
        group = self.replicate() if self.replicate is not None else None
        if sharded:
            return Topology(self.replicas, self.replicas, group, None, group)
        return Topology(self.replicas, 1, None, group, group)


def _groups(
    world: int, size: int, modules: Sequence[nn.Module]
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    if world == 1:
        return None, None
    if size == world:
        return dist.group.WORLD, None
    if size == 1:
        return None, dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    device = next((p.device.type for m in modules for p in m.parameters()), "cpu")
    mesh = init_device_mesh(device, (world // size, size), mesh_dim_names=("replicate", "tp"))
    return mesh.get_group("tp"), mesh.get_group("replicate")
