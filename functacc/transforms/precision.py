"""Mixed precision: low-precision compute, float32 master weights, dynamic loss scaling.

The forward pass and the loss run under ``torch.autocast`` inside the traced step, so the
graph gets exactly autocast's casts: matrix multiplies and convolutions in the low-precision
type, numerically sensitive ops (softmax, norms, losses) in float32. Parameters and
optimizer state stay float32. With float16 the loss is scaled before backward and the
gradients unscaled after; a step whose gradients overflow is skipped (parameters and
optimizer state keep their exact bits) and the scale shrinks; after ``growth_interval`` good
steps it grows. The scale is state of the graph: no host synchronisation is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Precision", "resolve_precision"]

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    """Mixed precision for :func:`functacc.compile_step`.

    Example:
        >>> import torch, functacc
        >>> p = functacc.Precision("fp16", init_scale=2.0**12, growth_interval=1000)
        >>> p.dtype, p.loss_scaling
        (torch.float16, True)
    """

    dtype: Any
    """``"bf16"`` / ``torch.bfloat16`` or ``"fp16"`` / ``torch.float16``."""
    _: KW_ONLY
    init_scale: float = 2.0**16
    """Initial loss scale (float16 only)."""
    growth_interval: int = 2000
    """Good steps in a row after which the scale doubles."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        dtype = _DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"precision must be 'bf16' or 'fp16' (or torch.bfloat16 / torch.float16); got "
                f"{self.dtype!r}"
            )
        object.__setattr__(self, "dtype", dtype)
        if self.init_scale <= 0 or self.growth_interval < 1:
            raise ValueError(
                f"init_scale must be > 0 and growth_interval >= 1; got {self.init_scale}, "
                f"{self.growth_interval}"
            )
        if not (self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0):
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")

    @property
    def loss_scaling(self) -> bool:
        """float16 needs a loss scale (its range ends at 65504); bfloat16 does not."""
        return self.dtype == torch.float16

    def init_state(self, device: torch.device) -> dict[str, Tensor]:
        if not self.loss_scaling:
            return {}
        return {
            "scale": torch.tensor(self.init_scale, dtype=torch.float32, device=device),
            "growth_tracker": torch.zeros((), dtype=torch.int64, device=device),
            "skipped": torch.zeros((), dtype=torch.int64, device=device),
        }

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        with torch.autocast(device_type, dtype=self.dtype):
            yield

    def unscale(self, grads: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> tuple:
        """Gradients divided by the scale, and whether any of them is inf or NaN."""
        inv = (1.0 / state["scale"]).to(torch.float32)
        unscaled = {n: g * inv.to(g.dtype) for n, g in grads.items()}
        finite = torch.stack([torch.isfinite(g).all() for g in unscaled.values()]).all()
        return unscaled, ~finite

    def next_state(self, state: Mapping[str, Tensor], found_inf: Tensor) -> dict[str, Tensor]:
        """GradScaler's update, as tensor math: back off on overflow, grow after
        ``growth_interval`` good steps in a row."""
        tracker = torch.where(found_inf, 0, state["growth_tracker"] + 1)
        grow = tracker >= self.growth_interval
        scale = torch.where(
            found_inf,
            state["scale"] * self.backoff_factor,
            torch.where(grow, state["scale"] * self.growth_factor, state["scale"]),
        )
        return {
            "scale": scale,
            "growth_tracker": torch.where(grow, 0, tracker),
            "skipped": state["skipped"] + found_inf.to(torch.int64),
        }


def resolve_precision(precision: Any) -> Precision | None:
    """``None``, a dtype name, a dtype, or a :class:`Precision`."""
    if precision is None or isinstance(precision, Precision):
        return precision
    if isinstance(precision, (str, torch.dtype)):
        return Precision(precision)
    raise TypeError(
        f"precision must be None, 'bf16', 'fp16' or functacc.Precision(...); got "
        f"{type(precision).__name__}"
    )
