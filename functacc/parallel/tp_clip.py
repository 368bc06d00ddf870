"""Gradient clipping of a tensor-parallel model, and what a jitted body's ``backward()`` and
``clip_grad_norm_`` do under tensor parallelism.

Each rank holds a slice of the split parameters' gradients, so ``torch.nn.utils
.clip_grad_norm_`` on one rank would see part of the norm (and ranks would scale by different
factors). :func:`clip_grad_norm_` sums the split parameters' squares over the group; while
:func:`functacc.jit` traces a body with ``parallel=TensorParallel(...)``, torch's
``clip_grad_norm_`` is that function (:class:`TensorParallelGradients`), so the body is the
one written for one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .tensor_parallel import split_norm

__all__ = ["TensorParallelGradients", "clip_grad_norm_"]


def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, *, group: Any = None
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` for a model split
    by :class:`~functacc.parallel.TensorParallel`: the norm of the whole gradient over the
    ranks' slices, the same scale on every rank. Returns the total norm.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> model(torch.ones(3, 4)).sum().backward()
        >>> norm = clip_grad_norm_(model, 1.0)  # a model not split: torch's result
        >>> grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        >>> float(torch.linalg.vector_norm(grads)) <= 1.0 + 1e-5
        True
    """
    layout = getattr(model, "_functacc_tensor_parallel", None)
    split = set(layout.dims) if layout is not None else set()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    return _clip(
        [p for n, p in named if n not in split],
        [p for n, p in named if n in split],
        max_norm,
        norm_type,
        layout.group if layout is not None else group,
    )


def _clip(
    whole: list[Tensor],
    split: list[Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | None,
) -> Tensor:
    if float(norm_type) != 2.0:
        raise ValueError(f"clipping a tensor-parallel model takes norm_type=2.0; got {norm_type!r}")
    if not whole + split:
        return torch.zeros(())
    norm = split_norm([p.grad for p in whole], [p.grad for p in split], group)
    torch.nn.utils.clip_grads_with_norm_(whole + split, max_norm, norm)  # torch's scaling
    return norm


class TensorParallelGradients:
    """A jitted body's gradients under tensor parallelism: ``inner``'s (data parallel across
    the groups, or ``None``), and ``clip_grad_norm_`` on the split parameters' slices
    computing the whole norm."""

    def __init__(self, inner: Any, split: Mapping[str, Any]):
        self.inner = inner
        self.split = split  # capture name -> the group it is split over
        self.transient = inner.transient if inner is not None else frozenset()

    def sync_buffers(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.inner.sync_buffers(buffers) if self.inner is not None else buffers

    @contextlib.contextmanager
    def reducing_backward(
        self, leaves: Mapping[str, Tensor], carried: Mapping[str, Tensor] | None = None
    ) -> Iterator[None]:
        split_ids = {id(leaves[n]): g for n, g in self.split.items() if n in leaves}
        group = next(iter(self.split.values()), None)

        def clip(
            parameters: Iterable[Tensor] | Tensor,
            max_norm: float,
            norm_type: float = 2.0,
            error_if_nonfinite: bool = False,
            foreach: bool | None = None,
        ) -> Tensor:
            params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            params = [p for p in params if p.grad is not None]
            whole = [p for p in params if id(p) not in split_ids]
            parts = [p for p in params if id(p) in split_ids]
            return _clip(whole, parts, max_norm, norm_type, group)

        with contextlib.ExitStack() as stack:
            if self.inner is not None:
                stack.enter_context(self.inner.reducing_backward(leaves))
            for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
                stack.enter_context(_patched(owner, "clip_grad_norm_", clip))
            yield

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
