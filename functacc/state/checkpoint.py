"""Sharded, resharding checkpoints of a training step, on ``torch.distributed.checkpoint``.

A checkpoint stores every tensor by a layout-independent name: each parameter (and each
per-parameter optimizer tensor) as the flat vector of its elements, whatever the layout that
wrote it. Under ZeRO each rank writes only the slices its shards hold (as a sharded tensor
with their offsets), so no rank gathers anything; on load, ``torch.distributed.checkpoint``
reads exactly the slices the new layout needs — a checkpoint written by ZeRO-3 on 2 ranks
loads into one process, into data parallelism, or into ZeRO-1 on 4 ranks. Loading writes
straight into the live tensors of the step.

Besides parameters, buffers and optimizer state, a checkpoint holds the step count, the
loss-scale state, every rank's RNG state and the DeviceLoader's position, so a resumed run
continues bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from ..data import DeviceLoader
from ..optim import AdamState, SGDState
from ..parallel.mesh import rank, world_size
from ..parallel.zero import FlatUnit, Sharded
from .safe_io import CheckpointError, SafeFileSystemReader, read_metadata

__all__ = ["CheckpointError", "load", "load_model", "save", "save_model"]

_PER_PARAM_STATES = (AdamState, SGDState)


# The random states a one-process DeviceLoader records; absent from checkpoints written
# under torchrun (whose loaders draw from a shared seed).
_OPTIONAL_LOADER_KEYS = ("loader.rng", "loader.base_seed")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class _Layout:
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
        state = step.state
        self._params(state.params)
        for name, buf in state.buffers.items():
            self._plain(f"buffers.{name}", buf.detach())
        self._optimizer(state.opt_state, "optim")
        self.entries["count"] = state.count
        for path, leaf in _tensor_leaves(state.extra or {}, "extra"):
            self._per_rank(path, leaf)
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
            else:
                self._plain(f"params.{name}", p.detach())
        for name, shape in self._param_shapes().items():
            self.entries[f"shapes.params.{name}"] = torch.tensor(list(shape), dtype=torch.int64)

    def _param_shapes(self) -> dict[str, torch.Size]:
        shapes = {n: p.shape for n, p in self.step.state.params.items() if n not in self.units}
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
                f"{_short(missing)}; parameters in it the model does not have: "
                f"{_short(unexpected)}"
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


def _last_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _short(names: list[str], limit: int = 8) -> str:
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


def _json_states(states: Mapping[str, Any] | None) -> dict[str, Any]:
    out = {}
    for name, obj in (states or {}).items():
        state = obj.state_dict()
        try:
            json.dumps(state)
        except TypeError as exc:
            raise TypeError(
                f"states[{name!r}].state_dict() must hold only numbers, strings, lists and "
                f"dicts (it is stored as JSON, which loading cannot turn into code): {exc}"
            ) from exc
        out[name] = state
    return out


def save(
    step: Any,
    path: str | os.PathLike,
    *,
    loader: DeviceLoader | None = None,
    states: Mapping[str, Any] | None = None,
) -> None:
    """Write everything needed to continue ``step`` bit for bit to the directory ``path``.

    Every rank calls it; each writes its own shards (no gather to rank 0). The checkpoint is
    written to ``path + ".partial"`` and swapped into place when complete: a crash at any
    point leaves ``path`` a whole checkpoint, the previous or the new one (where the file
    system cannot swap directories atomically, for a moment the previous one is only at
    ``path + ".old"``, which :func:`load` then reads). ``loader`` adds the DeviceLoader's
    position; ``states`` adds objects with JSON-able ``state_dict()`` (an LR scheduler).

    Example:
        >>> import os, tempfile, torch, functacc
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
        >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> path = os.path.join(tempfile.mkdtemp(), "step_1")
        >>> functacc.save(step, path, states={"sched": sched})
        >>> functacc.load(step, path, states={"sched": sched})
        >>> step.count
        1
    """
    path = os.fspath(path)
    partial = path + ".partial"
    layout = _Layout(step, loader)
    extra_states = _json_states(states)
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    writer = dcp.FileSystemWriter(partial)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(layout.entries, storage_writer=writer, no_dist=not _distributed())
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(
            f"checkpoint {path!r} could not be written to {partial!r}: {_last_line(exc)}; "
            f"the previous checkpoint at {path!r}, if any, is untouched"
        ) from exc
    if rank() == 0:
        with open(os.path.join(partial, "states.json"), "w") as f:
            json.dump(extra_states, f)
    _barrier()
    if rank() == 0:
        _install(partial, path)
    _barrier()


def _backup(path: str) -> str:
    return path + ".old"


def _exchange(a: str, b: str) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or file system cannot."""
    import ctypes
    import errno
    import sys

    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # glibc older than 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a!r} and {b!r}: {os.strerror(err)}")


def _install(partial: str, path: str) -> None:
    """Put the complete checkpoint ``partial`` at ``path`` so that a crash at any instant
    leaves a complete checkpoint, old or new, to load.

    Where the old one can be swapped with the new one atomically, ``path`` always holds a
    complete checkpoint. Elsewhere the old one is first renamed to ``path + ".old"``, the
    new one renamed into place, then the old one deleted: between the two renames ``path``
    is absent and :func:`load` reads the backup. Deleting the previous checkpoint only ever
    happens once its successor is complete at ``path``."""
    backup = _backup(path)
    if os.path.isdir(path):
        if _exchange(partial, path):
            shutil.rmtree(partial)  # now the old checkpoint
            shutil.rmtree(backup, ignore_errors=True)
            return
        shutil.rmtree(backup, ignore_errors=True)  # path is complete: an older backup is not needed
        os.replace(path, backup)
    os.replace(partial, path)
    shutil.rmtree(backup, ignore_errors=True)


def _readable(path: str) -> str:
    """``path``, or its backup when a save was interrupted between the renames of
    :func:`_install` (``path`` absent, the previous checkpoint complete under the backup)."""
    backup = _backup(path)
    if not os.path.exists(path) and os.path.isfile(os.path.join(backup, ".metadata")):
        warnings.warn(
            f"no checkpoint at {path!r}, but the previous one is complete at {backup!r} (a "
            "save over it was interrupted); loading that",
            stacklevel=3,
        )
        return backup
    return path


def load(
    step: Any,
    path: str | os.PathLike,
    *,
    loader: DeviceLoader | None = None,
    states: Mapping[str, Any] | None = None,
) -> None:
    """Restore ``step`` (and ``loader``, ``states``) from the checkpoint at ``path``.

    The checkpoint may come from another layout or world size (resharding). Nothing in it
    is unpickled beyond the metadata's own classes; tensors load with ``weights_only``.
    Raises :class:`CheckpointError` naming what is missing, damaged or different.
    """
    path = _readable(os.fspath(path))
    metadata = read_metadata(path)
    layout = _Layout(step, loader)
    targets = layout.load_targets(metadata, path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=not _distributed())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
        raise CheckpointError(
            f"checkpoint {path!r} could not be read: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}. A data file is "
            "damaged or truncated (a crash while writing?); use an earlier checkpoint."
        ) from exc
    for temp, live in layout.fixups:
        with torch.no_grad():
            live.copy_(temp.view_as(live))
    _restore_host_state(step, layout, targets, loader, states, path)


def _restore_host_state(
    step: Any,
    layout: _Layout,
    targets: Mapping[str, Any],
    loader: DeviceLoader | None,
    states: Mapping[str, Any] | None,
    path: str,
) -> None:
    key = f"rank{rank()}.rng.cpu"
    if key in targets:
        torch.set_rng_state(targets[key])
    cuda_keys = sorted(k for k in targets if k.startswith(f"rank{rank()}.rng.cuda"))
    if cuda_keys:
        torch.cuda.set_rng_state_all([targets[k] for k in cuda_keys])
    if world_size() > 1 and key not in targets:
        warnings.warn(
            f"checkpoint {path!r} has no RNG state for rank {rank()} (written by fewer ranks); "
            "this rank keeps its current random state",
            stacklevel=3,
        )
    if loader is not None:
        loader.load_state_dict(
            {k[len("loader.") :]: v for k, v in targets.items() if k.startswith("loader.")}
        )
    step._calls = int(step.state.count)
    step._state.after_load()
    if states:
        with open(os.path.join(path, "states.json")) as f:
            saved = json.load(f)
        for name, obj in states.items():
            if name not in saved:
                raise CheckpointError(f"checkpoint {path!r} has no saved state {name!r}")
            obj.load_state_dict(saved[name])


def _model_and_step(target: Any) -> tuple[torch.nn.Module, Any]:
    from ..frontends.step import Step

    if isinstance(target, Step):
        return target.model, target
    if isinstance(target, torch.nn.Module):
        return target, None
    raise TypeError(f"expected a torch.nn.Module or a functacc.Step; got {type(target).__name__}")


def save_model(model_or_step: Any, path: str | os.PathLike) -> None:
    """Write the full model weights (parameters and persistent buffers) as one
    ``safetensors`` file, for inference and export. Under ZeRO-3 the shards are gathered
    first (every rank must call it); rank 0 writes.

    Example:
        >>> import torch, functacc, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> functacc.save_model(torch.nn.Linear(2, 2), path)
    """
    from safetensors.torch import save_file

    model, step = _model_and_step(model_or_step)
    if step is not None:
        synced = step._strategy.model_synced
        step.sync_model()
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tensors = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()}
    if step is not None and not synced:  # ZeRO-3: the model goes back to its placeholders
        step._strategy.release_model_params(step._params)
    if rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = os.fspath(path) + ".partial"
        # safetensors refuses tensors that share memory (tied weights): store each once.
        seen: dict[int, str] = {}
        unique = {}
        for k, v in tensors.items():
            if v.data_ptr() in seen and v.numel():
                continue
            seen[v.data_ptr()] = k
            unique[k] = v
        save_file(unique, tmp, metadata={"format": "pt", "producer": "functacc"})
        os.replace(tmp, path)
    _barrier()


def load_model(model_or_step: Any, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Load weights written by :func:`save_model` (or any ``safetensors`` state dict) into
    a model, or into a step's live state (re-sharded under ZeRO-3). Safetensors holds raw
    tensors only: loading runs no code."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model, step = _model_and_step(model_or_step)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no model file at {path!r}")
    try:
        loaded = load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path!r} is not a readable safetensors file: {exc}") from exc
    if step is not None:
        synced = step._strategy.model_synced
        step.sync_model()
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in loaded and not _tied(model, k, loaded))
    unexpected = sorted(k for k in loaded if k not in expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path!r} is of a different model: missing {_short(missing)}; unexpected "
            f"{_short(unexpected)}"
        )
    for name, value in loaded.items():
        if name in expected and tuple(expected[name].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{path!r}: {name!r} has shape {tuple(value.shape)} in the file but "
                f"{tuple(expected[name].shape)} in the model"
            )
    model.load_state_dict(loaded, strict=False)
    if step is not None:
        step._state.load_full_params()
        if not synced:  # ZeRO-3: the model goes back to its placeholders
            step._strategy.release_model_params(step._params)


def _tied(model: torch.nn.Module, key: str, loaded: Mapping[str, Tensor]) -> bool:
    """Whether ``key`` shares its tensor with a key present in ``loaded`` (tied weights)."""
    state = model.state_dict(keep_vars=True)
    target = state[key]
    return any(state[k] is target for k in loaded if k in state)
