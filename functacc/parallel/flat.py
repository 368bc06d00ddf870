"""The flat layout ZeRO shards: a unit's parameters as one padded vector in equal chunks.

Rank r of a shard group of n ranks owns the r-th of a unit's n equal chunks; a
:class:`Segment` is the part of one parameter inside a chunk (possibly empty), which is
what the optimizer updates and what a checkpoint writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["FlatUnit", "Segment"]


@dataclass
class FlatUnit:
    """Parameters flattened into one padded vector, sharded in equal chunks."""

    key: str
    module: str
    group: int
    names: list[str]
    shapes: list[torch.Size]
    dtype: torch.dtype
    device: torch.device
    shard_size: int
    numels: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.numels = [math.prod(s) for s in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def chunk(self) -> int:
        return -(-self.total // self.shard_size)

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """Concatenate and zero-pad to ``shard_size`` equal chunks."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.chunk * self.shard_size - self.total
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def my_chunk(self, flat: Tensor, shard_rank: int) -> Tensor:
        return flat[shard_rank * self.chunk : (shard_rank + 1) * self.chunk]

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        pieces = flat[: self.total].split(self.numels)
        return {n: p.view(s) for n, p, s in zip(self.names, pieces, self.shapes, strict=True)}

    def segments(self, shard_rank: int) -> dict[str, Segment]:
        """Where each parameter's part inside chunk ``shard_rank`` lies (possibly empty)."""
        lo, hi = shard_rank * self.chunk, (shard_rank + 1) * self.chunk
        out, offset = {}, 0
        for name, numel in zip(self.names, self.numels, strict=True):
            a = min(max(offset, lo), hi)
            b = max(min(offset + numel, hi), a)
            out[name] = Segment(self, a - lo, b - lo, a - offset if b > a else 0)
            offset += numel
        return out

    def covered(self, shard_rank: int) -> int:
        """Elements of chunk ``shard_rank`` that hold parameters (the rest is padding)."""
        lo = shard_rank * self.chunk
        return max(0, min(lo + self.chunk, self.total) - lo)


@dataclass(frozen=True, eq=False)
class Segment:
    """The part of one parameter inside this rank's chunk of its unit: chunk elements
    ``[start, stop)``, which are the parameter's flat elements from ``offset``."""

    unit: FlatUnit
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start
