"""Reading checkpoints without running code from them.

``torch.distributed.checkpoint`` reads tensor data with ``torch.load(weights_only=True)``,
but its ``.metadata`` file is a plain pickle, and unpickling runs whatever the file names.
A checkpoint directory is data someone else may have written, so the metadata goes through
an unpickler that only builds the handful of classes a checkpoint's metadata consists of.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["CheckpointError", "SafeFileSystemReader", "read_metadata"]

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, unsafe, or belongs to a different model."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"refusing to load the checkpoint metadata: it references {module}.{name}, which "
            "checkpoint metadata never contains, and unpickling it could run code. The "
            "checkpoint is damaged or was tampered with; do not load it."
        )


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The metadata of the checkpoint at ``path``, unpickled safely."""
    file = os.path.join(path, ".metadata")
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: the directory does not exist")
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{path!r} is not a complete checkpoint: its .metadata file is missing (a save "
            "that did not finish?)"
        )
    with open(file, "rb") as f:
        data = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"the metadata of checkpoint {path!r} cannot be read ({type(exc).__name__}: {exc}); "
            "the file is damaged or truncated"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file!r} does not hold checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank metadata files are not supported")
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
