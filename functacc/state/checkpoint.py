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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..data import DeviceLoader
from ..parallel.mesh import rank, world_size
from .body_layout import BodyLayout
from .layout import Layout, barrier, distributed, last_line
from .safe_io import CheckpointError, SafeFileSystemReader, read_metadata

__all__ = ["CheckpointError", "load", "save"]


def layout_of(step: Any, loader: DeviceLoader | None) -> Layout:
    """The checkpoint names of ``step``: the model's, the optimizer's and the scaler's."""
    from ..frontends.step import Step

    if not isinstance(step, Step):
        raise TypeError(
            f"save() and load() take the step from functacc.compile_step; got "
            f"{type(step).__name__}. For a functacc.jit step, save its modules' and "
            "optimizers' state_dict() (the jitted step keeps them live)"
        )
    return BodyLayout(step, loader)


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
    layout = layout_of(step, loader)
    extra_states = _json_states(states)
    if rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    writer = dcp.FileSystemWriter(partial)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(layout.entries, storage_writer=writer, no_dist=not distributed())
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(
            f"checkpoint {path!r} could not be written to {partial!r}: {last_line(exc)}; "
            f"the previous checkpoint at {path!r}, if any, is untouched"
        ) from exc
    if rank() == 0:
        for name, document in {**layout.documents, "states.json": extra_states}.items():
            with open(os.path.join(partial, name), "w") as f:
                json.dump(document, f)
    barrier()
    if rank() == 0:
        _install(partial, path)
    barrier()


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
    layout = layout_of(step, loader)
    targets = layout.load_targets(metadata, path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(targets, storage_reader=SafeFileSystemReader(path), no_dist=not distributed())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException: BaseException
        raise CheckpointError(
            f"checkpoint {path!r} could not be read: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}. A data file is "
            "damaged or truncated (a crash while writing?); use an earlier checkpoint."
        ) from exc
    layout.apply_fixups()
    _restore_host_state(step, layout, targets, loader, states, path)


def _restore_host_state(
    step: Any,
    layout: Layout,
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
    layout.finish_load(targets, path)
    if states:
        with open(os.path.join(path, "states.json")) as f:
            saved = json.load(f)
        for name, obj in states.items():
            if name not in saved:
                raise CheckpointError(f"checkpoint {path!r} has no saved state {name!r}")
            obj.load_state_dict(saved[name])
