"""A training step's state as a checkpoint sees it: layout-independent names.

Each parameter (and each per-parameter optimizer tensor) is stored as the flat vector of
its elements, whatever the layout that wrote it; under ZeRO a rank's shards are slices of
those vectors with their offsets. :class:`Layout` maps the names to views of the step's
live tensors, for writing, and to the targets a load fills in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from ..data import DeviceLoader
from ..optim import AdamState, SGDState
from ..parallel.flat import FlatUnit
from ..parallel.mesh import rank
from ..parallel.zero import Sharded
from .safe_io import CheckpointError, SafeFileSystemReader, read_metadata

__all__ = ["Layout", "barrier", "distributed", "last_line", "short"]

# The random states a one-process DeviceLoader records; absent from checkpoints written
# under torchrun (whose loaders draw from a shared seed).
_OPTIONAL_LOADER_KEYS = ("loader.rng", "loader.base_seed")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if distributed():
        dist.barrier()


_PER_PARAM_STATES = (AdamState, SGDState)


class Layout:
    """The checkpoint's name -> tensor mapping for a step, as views of its live tensors."""

    def __init__(self, step: Any, loader: DeviceLoader | None):
        self.step = step
        self.strategy = step._strategy
        self.sharded = isinstance(self.strategy, Sharded)
        self.units: dict[str, FlatUnit] = (
            {u.key: u for u in self.strategy.units} if self.sharded else {}
        )
        self.entries: dict[str, Any] = {}
        self.per_rank: set[str] = set()
        self.fixups: list[tuple[Tensor, Tensor]] = []  # (loaded temp, live destination)
        # Tensor parallel: a split parameter (and its optimizer state) is stored whole,
        # gathered over its group, and loaded through a whole temporary (name, temp, live).
        self.split = getattr(self.strategy, "tensor_parallel", None)
        self.split_fixups: list[tuple[str, Tensor, Tensor]] = []
        if self.split is not None and self.sharded:
            raise CheckpointError(
                "checkpoints of a step with TensorParallel and ZeRO together are not "
                "supported yet; save with [TensorParallel(...), DataParallel()], or gather "
                "the model with model._functacc_tensor_parallel.full_state_dict(model)"
            )
        state = step.state
        self._params(state.params)
        for name, buf in state.buffers.items():
            self._plain(f"buffers.{name}", buf.detach())
        self._optimizer(state.opt_state, "optim")
        self.entries["count"] = state.count
        for path, leaf in _tensor_leaves(state.extra or {}, "extra"):
            self._per_rank(path, leaf)
        self.documents: dict[str, Any] = {}  # JSON files beside the tensors, by name
        self._host_state(loader)

    def _host_state(self, loader: DeviceLoader | None) -> None:
        """Every rank's RNG states and the loader's position."""
        self._per_rank("rng.cpu", torch.get_rng_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                self._per_rank(f"rng.cuda{i}", s)
        if loader is not None:
            # The position, and in one process the random states the epoch was drawn from.
            for key, value in loader.state_dict().items():
                self.entries[f"loader.{key}"] = torch.as_tensor(value)

    def finish_load(self, targets: Mapping[str, Any], path: str) -> None:
        """After the tensors are in place: the step's own bookkeeping."""
        self.step._calls = int(self.step.state.count)
        self.step._state.after_load()

    # -- building ----------------------------------------------------------------------
    def _plain(self, key: str, t: Tensor) -> None:
        if t.dim() == 0:
            self.entries[key] = t
        elif t.is_contiguous():
            self.entries[key] = t.view(-1)
        else:  # loads into a contiguous copy, copied back afterwards
            temp = t.reshape(-1).clone()
            self.fixups.append((temp, t))
            self.entries[key] = temp

    def _whole(self, key: str, name: str, t: Tensor) -> None:
        whole = self.split.gather(name, t).reshape(-1)  # a collective of the group
        self.split_fixups.append((name, whole, t))
        self.entries[key] = whole

    def apply_fixups(self) -> None:
        """After loading: copy the temporaries into the live tensors."""
        with torch.no_grad():
            for temp, live in self.fixups:
                live.copy_(temp.view_as(live))
            for name, temp, live in self.split_fixups:
                shape = list(live.shape)
                shape[self.split.dims[name]] *= self.split.size
                live.copy_(self.split.slice(name, temp.view(shape)))

    def _per_rank(self, key: str, t: Tensor) -> None:
        full = f"rank{rank()}.{key}"
        self.entries[full] = t
        self.per_rank.add(full)

    def _params(self, params: Mapping[str, Tensor]) -> None:
        for name, p in params.items():
            if name in self.units:
                unit = self.units[name]
                for param, view in self._unit_slices(unit, p.detach()).items():
                    self.entries[f"params.{param}"] = view
            elif self.split is not None and name in self.split.dims:
                self._whole(f"params.{name}", name, p.detach())
            else:
                self._plain(f"params.{name}", p.detach())
        for name, shape in self._param_shapes().items():
            self.entries[f"shapes.params.{name}"] = torch.tensor(list(shape), dtype=torch.int64)

    def _param_shapes(self) -> dict[str, torch.Size]:
        shapes = {n: p.shape for n, p in self.step.state.params.items() if n not in self.units}
        for name, dim in (self.split.dims if self.split is not None else {}).items():
            if name in shapes:
                whole = list(shapes[name])
                whole[dim] *= self.split.size
                shapes[name] = torch.Size(whole)
        for unit in self.units.values():
            shapes.update(zip(unit.names, unit.shapes, strict=True))
        return shapes

    def _unit_slices(self, unit: FlatUnit, chunk: Tensor) -> dict[str, Any]:
        """The parts of each parameter of ``unit`` inside this rank's ``chunk``, as sharded
        tensors over the shard group (global shape: the parameter's element count)."""

        return {
            name: self._segment(name, chunk[seg.start : seg.stop])
            for name, seg in self.strategy.segment_of.items()
            if seg.unit is unit
        }

    def _segment(self, name: str, local: Tensor) -> Any:
        """This rank's segment of parameter ``name`` (or of its optimizer state), as a
        sharded tensor over the shard group (global shape: the parameter's element count)."""
        from torch.distributed._shard.sharded_tensor import (
            Shard,
            ShardMetadata,
            init_from_local_shards,
        )

        seg = self.strategy.segment_of[name]
        numel = seg.unit.numels[seg.unit.names.index(name)]
        device = local.device.type if local.device.type == "cpu" else str(local.device)
        shards = []
        if seg.numel:
            meta = ShardMetadata([seg.offset], [seg.numel], f"rank:{dist.get_rank()}/{device}")
            shards.append(Shard(local, meta))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice
            return init_from_local_shards(
                shards, [numel], process_group=self.strategy.topology.shard_group
            )

    def _optimizer(self, node: Any, path: str) -> None:
        if isinstance(node, _PER_PARAM_STATES):
            for field in node._fields:
                value = getattr(node, field)
                if field == "hyperparams" or not isinstance(value, dict):
                    for sub, leaf in _tensor_leaves(value, f"{path}.{field}"):
                        self.entries[sub] = leaf
                    continue
                for key, t in value.items():
                    self._optimizer_tensor(f"{path}.{field}", key, t)
        elif isinstance(node, (tuple, list)):
            for i, child in enumerate(node):
                self._optimizer(child, f"{path}.{i}")
        elif isinstance(node, dict):
            for k, child in node.items():
                self._optimizer(child, f"{path}.{k}")
        elif isinstance(node, Tensor):
            # A state this module does not know the structure of: saved as it is held.
            if self.sharded:
                self._per_rank(path, node)
            else:
                self.entries[path] = node

    def _optimizer_tensor(self, path: str, key: str, t: Tensor) -> None:
        # Under ZeRO the optimizer holds each parameter's segment (scalars such as Adam's
        # step whole, the same on every rank).
        if self.sharded and key in self.strategy.sharded_names and t.dim() > 0:
            self.entries[f"{path}.{key}"] = self._segment(key, t)
        elif self.split is not None and key in self.split.dims and t.dim() > 0:
            self._whole(f"{path}.{key}", key, t)
        else:
            self._plain(f"{path}.{key}", t)

    # -- loading -----------------------------------------------------------------------
    def load_targets(self, metadata: Any, path: str) -> dict[str, Any]:
        """The entries to load, after checking names, shapes and dtypes."""
        stored = metadata.state_dict_metadata
        targets = {}
        for key, value in self.entries.items():
            if key in _OPTIONAL_LOADER_KEYS and key not in stored:
                continue  # written under torchrun: DeviceLoader.load_state_dict warns
            if key in self.per_rank and key not in stored:
                # Written by fewer ranks: step-transform state (the loss scale) is the same
                # on every rank, so rank 0's serves; this rank keeps its own RNG state.
                fallback = "rank0." + key.split(".", 1)[1]
                if ".extra." in key and fallback in stored:
                    targets[fallback] = value
                continue
            targets[key] = value
        self._check(stored, targets, path)
        return targets

    def _check(self, stored: Mapping[str, Any], targets: Mapping[str, Any], path: str) -> None:
        want = {k[len("params.") :] for k in targets if k.startswith("params.")}
        have = {k[len("params.") :] for k in stored if k.startswith("params.")}
        if want != have:
            missing, unexpected = sorted(want - have), sorted(have - want)
            raise CheckpointError(
                f"checkpoint {path!r} is of a different model: parameters missing from it: "
                f"{short(missing)}; parameters in it the model does not have: "
                f"{short(unexpected)}"
            )
        for key, target in targets.items():
            if key not in stored:
                raise CheckpointError(
                    f"checkpoint {path!r} lacks {key!r}, which this step needs (was it "
                    "written with a different optimizer, or without the loader?)"
                )
            meta = stored[key]
            size = tuple(target.size())
            if tuple(meta.size) != size:
                name = key.split(".", 1)[1] if key.startswith("params.") else key
                saved = self._saved_shape(name, path, tuple(meta.size))
                raise CheckpointError(
                    f"checkpoint {path!r}: {key!r} has shape {saved} in the checkpoint but "
                    f"{self._param_shapes().get(name, size)} in the model; the checkpoint is "
                    "of a different model configuration"
                )
            dtype = getattr(target, "dtype", None)
            saved_dtype = meta.properties.dtype
            if dtype is not None and saved_dtype != dtype:
                raise CheckpointError(
                    f"checkpoint {path!r}: {key!r} is {saved_dtype} in the checkpoint but "
                    f"{dtype} in the model; convert the model (model.to(dtype)) before loading"
                )

    def _saved_shape(self, name: str, path: str, fallback: tuple) -> tuple:
        shape = torch.zeros(0, dtype=torch.int64)
        key = f"shapes.params.{name}"
        try:
            metadata = read_metadata(path).state_dict_metadata
            if key in metadata:
                shape = torch.zeros(tuple(metadata[key].size), dtype=torch.int64)
                dcp.load({key: shape}, storage_reader=SafeFileSystemReader(path), no_dist=True)
                return tuple(int(s) for s in shape)
        except Exception:
            pass
        return fallback


def last_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _tensor_leaves(tree: Any, prefix: str) -> list[tuple[str, Tensor]]:
    import torch.utils._pytree as pytree

    out = []
    for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, Tensor):
            key = pytree.keystr(path).replace("[", ".").replace("]", "").replace("'", "")
            out.append((prefix + key, leaf))
    return out
