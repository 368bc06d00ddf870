"""``functacc.Config``: the TorchAcc-compatible configuration tree for ``accelerate``.

Sections are attributes (``config.compute.bf16 = True``, ``config.dist.fsdp.size = 4``).
Setting an attribute a section does not have raises (a typo would otherwise be ignored);
``validate()`` checks the whole tree and names the offending field.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..data.buckets import make_padder

__all__ = [
    "ComputeConfig",
    "Config",
    "DPConfig",
    "DataLoaderConfig",
    "DistConfig",
    "FSDPConfig",
    "MemoryConfig",
]


class _Section:
    """A config section whose attributes are its dataclass fields, nothing else."""

    _path = ""

    def __setattr__(self, name: str, value: Any) -> None:
        allowed = [f.name for f in fields(self)]  # type: ignore[arg-type]
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" Did you mean {self._path}.{close[0]}?" if close else ""
            raise AttributeError(
                f"{self._path or 'Config'} has no field {name!r}; its fields are "
                f"{', '.join(allowed)}.{hint}"
            )
        object.__setattr__(self, name, value)


@dataclass(kw_only=True)
class ComputeConfig(_Section):
    """Numeric precision of the forward and backward computation."""

    _path = "compute"
    fp16: bool = False
    """Compute in float16 (autocast; float32 master weights)."""
    bf16: bool = False
    """Compute in bfloat16 (autocast; float32 master weights)."""
    compile: bool = True
    """``torch.compile`` the model (a functacc addition; off runs PyTorch's engines eagerly,
    for debugging and bit-exact comparisons)."""


@dataclass(kw_only=True)
class MemoryConfig(_Section):
    """Memory savings."""

    _path = "memory"
    gc: bool = False
    """Gradient (activation) checkpointing: recompute activations in backward."""
    gc_cls: set[str] | None = None
    """Class names of the modules to checkpoint (required when ``gc`` is on)."""


@dataclass(kw_only=True)
class DPConfig(_Section):
    """Data parallelism (replication)."""

    _path = "dist.dp"
    size: int | None = None
    """Number of data-parallel replicas; default: world size / ``dist.fsdp.size``."""


@dataclass(kw_only=True)
class FSDPConfig(_Section):
    """Fully sharded data parallelism (FSDP2 ``fully_shard``)."""

    _path = "dist.fsdp"
    size: int = 1
    """Ranks that shard parameters, gradients and optimizer state among themselves."""
    wrap_layer_cls: set[str] = field(default_factory=set)
    """Class names of the modules that become their own FSDP units."""


@dataclass(kw_only=True)
class DistConfig(_Section):
    """How the ranks split the work."""

    _path = "dist"
    dp: DPConfig = field(default_factory=DPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass(kw_only=True)
class DataLoaderConfig(_Section):
    """The data loader wrapper (:class:`functacc.DeviceLoader`). ``buckets``,
    ``max_length``, ``num_buckets`` and ``pad_value_dict`` are TorchAcc's, with its
    defaults; see :mod:`functacc.data.buckets`."""

    _path = "dataloader"
    prefetch: int = 2
    """Batches loaded and moved to the device ahead of use."""
    buckets: list[int] | None = None
    """Sequence lengths to pad the last dimension of the ``pad_value_dict`` keys up to (the
    smallest that holds each batch); ``max_length`` and ``num_buckets`` are then ignored."""
    max_length: int | None = None
    """Without ``buckets``: build ``num_buckets`` buckets up to this length. ``None`` (and
    no ``buckets``): no bucketing."""
    num_buckets: int | None = None
    """How many buckets ``max_length`` builds; ``None`` means 8 (TorchAcc's default)."""
    pad_value_dict: dict[str, float] | None = None
    """Key -> pad value; ``None`` means ``{'input_ids': 0, 'attention_mask': 0,
    'labels': -100}``. Keys not listed are left alone."""
    bucket_spacing: Literal["uniform", "geometric"] = "uniform"
    """How ``max_length`` builds buckets: uniform (TorchAcc's) or in a constant ratio (a
    functacc addition)."""
    truncation: bool = False
    """Cut a batch longer than the largest bucket to it instead of raising (a functacc
    addition)."""

    def bucket_options(self) -> dict[str, Any]:
        """The bucketing arguments of :class:`functacc.DeviceLoader`."""
        return {
            "buckets": self.buckets,
            "max_length": self.max_length,
            "num_buckets": self.num_buckets,
            "pad_values": self.pad_value_dict,
            "bucket_spacing": self.bucket_spacing,
            "truncation": self.truncation,
        }


_BUCKET_FIELDS = {
    "buckets": "dataloader.buckets",
    "max_length": "dataloader.max_length",
    "num_buckets": "dataloader.num_buckets",
    "pad_values": "dataloader.pad_value_dict",
    "bucket_spacing": "dataloader.bucket_spacing",
    "truncation": "dataloader.truncation",
}


@dataclass(kw_only=True)
class Config(_Section):
    """Configuration of :func:`functacc.accelerate` (TorchAcc's ``Config`` layout).

    Example:
        >>> import functacc
        >>> config = functacc.Config()
        >>> config.compute.bf16 = True
        >>> config.dist.fsdp.size = 2
        >>> config.dist.fsdp.wrap_layer_cls = {"Bottleneck"}
        >>> config.validate(world_size=2)
    """

    compute: ComputeConfig = field(default_factory=ComputeConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)

    def validate(self, *, world_size: int) -> None:
        """Raise ``ValueError`` naming the field if the configuration cannot work."""
        if self.compute.fp16 and self.compute.bf16:
            raise ValueError(
                "compute.fp16 and compute.bf16 are both True; choose one low-precision type"
            )
        for name in ("fp16", "bf16"):
            if not isinstance(getattr(self.compute, name), bool):
                raise ValueError(f"compute.{name} must be True or False")
        if self.memory.gc and not self.memory.gc_cls:
            raise ValueError(
                "memory.gc is True but memory.gc_cls is empty; name the module classes to "
                "checkpoint, e.g. config.memory.gc_cls = {'Bottleneck'}"
            )
        fsdp = self.dist.fsdp.size
        if not isinstance(fsdp, int) or fsdp < 1:
            raise ValueError(f"dist.fsdp.size must be an int >= 1; got {fsdp!r}")
        dp = self.dist.dp.size
        if dp is None:
            if world_size % fsdp:
                raise ValueError(
                    f"dist.fsdp.size={fsdp} does not divide the world size {world_size}"
                )
            dp = world_size // fsdp
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"dist.dp.size must be an int >= 1 or None; got {dp!r}")
        if dp * fsdp != world_size:
            raise ValueError(
                f"dist.dp.size ({dp}) x dist.fsdp.size ({fsdp}) must equal the world size "
                f"({world_size}); set dist.dp.size=None to derive it"
            )
        if fsdp > 1 and not isinstance(
            self.dist.fsdp.wrap_layer_cls, (set, frozenset, list, tuple)
        ):
            raise ValueError("dist.fsdp.wrap_layer_cls must be a set of class names")
        loader = self.dataloader
        if not isinstance(loader.prefetch, int) or loader.prefetch < 0:
            raise ValueError(f"dataloader.prefetch must be an int >= 0; got {loader.prefetch!r}")
        make_padder(**loader.bucket_options(), names=_BUCKET_FIELDS)

    def dp_size(self, world_size: int) -> int:
        return self.dist.dp.size or world_size // self.dist.fsdp.size
