"""A training step's state as a checkpoint sees it: layout-independent names.

Each tensor is stored whole, whatever the layout that wrote it (ZeRO's shards and tensor
parallelism's slices gathered while saving). :class:`Layout` maps the names to views of the
step's live tensors, for writing, and to the targets a load fills in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from ..data import DeviceLoader
from ..parallel.mesh import rank
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


class Layout:
    """The checkpoint's name -> tensor mapping for a step, as views of its live tensors:
    what every layout shares (:class:`~functacc.state.body_layout.BodyLayout` fills it).

    ``entries``: name -> tensor; ``per_rank``: the names each rank writes for itself;
    ``fixups``: (loaded temporary, live destination) for tensors loaded through a
    contiguous copy; ``split`` and ``split_fixups``: tensor parallelism's split tensors,
    stored whole and loaded through a whole temporary (name, temporary, live);
    ``documents``: JSON files beside the tensors, by name.
    """

    entries: dict[str, Any]
    per_rank: set[str]
    fixups: list[tuple[Tensor, Tensor]]
    split: Any
    split_fixups: list[tuple[str, Tensor, Tensor]]
    documents: dict[str, Any]

    def _param_shapes(self) -> dict[str, torch.Size]:
        raise NotImplementedError

    def finish_load(self, targets: Mapping[str, Any], path: str) -> None:
        """After the tensors are in place: the step's own bookkeeping."""
        raise NotImplementedError

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
