"""Data parallelism: every rank holds the whole model; gradients are averaged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .mesh import Topology
from .strategy import Replicated

__all__ = ["DataParallel"]


@dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Average gradients over all ranks with bucketed all-reduces inside the step graph.

    Example:
        >>> import functacc
        >>> dp = functacc.parallel.DataParallel(bucket_mb=25.0, compression="bf16")
    """

    bucket_mb: float = 25.0
    """Gradients are concatenated into buckets of at most this many MiB, one all-reduce
    each: fewer, larger messages."""
    compression: Any = None
    """``None``; ``"bf16"`` (send bfloat16, half the bytes); or :class:`PowerSGD`."""

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0; got {self.bucket_mb}")
        from .powersgd import PowerSGD

        if self.compression not in (None, "bf16") and not isinstance(self.compression, PowerSGD):
            raise ValueError(
                "compression must be None, 'bf16' or functacc.parallel.PowerSGD(rank=...); got "
                f"{self.compression!r}"
            )

    def build(self, model: nn.Module, groups: Sequence[Sequence[str]] | None) -> Replicated:
        return Replicated(Topology.build(1), bucket_mb=self.bucket_mb, compression=self.compression)
