"""Mixed precision: low-precision compute, float32 master weights, dynamic loss scaling.

``compile_step(..., precision=)`` writes eager's AMP recipe into its step: the forward
pass and the loss under ``torch.autocast`` (so the graph gets exactly autocast's casts:
matrix multiplies and convolutions in the low-precision type, numerically sensitive ops in
float32), parameters and optimizer state in float32, and with float16 a
``torch.amp.GradScaler`` of these settings (scale, unscale, skip a step whose gradients
overflow, back off, grow after ``growth_interval`` good steps) traced into the graph
(:mod:`functacc.core.grad_scaler`): no host synchronisation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

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

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        with torch.autocast(device_type, dtype=self.dtype):
            yield


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
