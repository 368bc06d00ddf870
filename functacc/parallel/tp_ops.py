"""The collectives of tensor parallelism, differentiable, and the loss over split logits.

Megatron-LM's four conjugate pairs, as ``torch.autograd.Function`` s over the functional
collectives of :mod:`functacc.parallel.comm`, so that they run eagerly (gloo, NCCL) and, traced
with the step (its backward too), become nodes of the step graph:

- :func:`copy_to`: identity forward, gradients summed over the group backward (the input of
  a column-wise split layer is whole on every rank; each rank's backward holds part of its
  gradient);
- :func:`reduce_from`: summed forward, identity backward (a row-wise split layer's partial
  products);
- :func:`gather_from`: all-gathered along a dimension forward, this rank's slice backward.

:func:`vocab_parallel_cross_entropy` is the cross-entropy of logits split by vocabulary over
the group (``lm_head`` column-wise), without gathering them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from .. import _compat

__all__ = ["copy_to", "gather_from", "reduce_from", "vocab_parallel_cross_entropy"]


def _all_reduce(t: Tensor, op: str, group: dist.ProcessGroup | None) -> Tensor:
    if group is None:  # one rank holds everything
        return t
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), op, group))


def _all_gather(t: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    dim = dim % t.dim()
    whole = funcol.wait_tensor(_compat.all_gather_single(t.contiguous(), 0, group))
    if dim == 0:
        return whole
    # Gathered along the first dimension (rank-major); the chunks go along ``dim``.
    return torch.cat(whole.chunk(size, 0), dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, "sum", ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, dist.get_rank(group), dist.get_world_size(group)
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad.chunk(ctx.size, ctx.dim)[ctx.rank].contiguous(), None, None


def copy_to(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``x`` itself forward; its gradient summed over ``group`` backward (``None``: one
    rank, ``x`` as is)."""
    return x if group is None else _CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``x`` summed over ``group`` forward; the gradient passed as is backward."""
    return x if group is None else _ReduceFrom.apply(x, group)


def gather_from(x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order forward; this rank's slice
    of the gradient backward."""
    return x if group is None else _GatherFrom.apply(x, dim, group)


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: dist.ProcessGroup | nn.Module | None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy`` of logits whose last dimension (the vocabulary) is split over
    ``group`` in rank order, each rank holding ``logits`` of its own ``V / size`` entries;
    ``target`` holds global vocabulary ids, the same on every rank. The logits are never
    gathered: the maximum, the sum of exponentials and the target's logit are all-reduced
    (three messages of one value per token). The result is the same on every rank.
    ``group`` may be the model split by :class:`~functacc.parallel.TensorParallel` (its
    group; a model not split: one rank), ``None`` is one rank holding the whole vocabulary.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> logits, target = torch.randn(4, 10), torch.tensor([1, 9, -100, 3])
        >>> loss = vocab_parallel_cross_entropy(logits, target, None)
        >>> torch.allclose(loss, F.cross_entropy(logits, target))
        True
    """
    if isinstance(group, nn.Module):
        layout = getattr(group, "_functacc_tensor_parallel", None)
        group = layout.group if layout is not None else None
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            "vocab_parallel_cross_entropy takes logits (..., V / ranks) and target (...) of "
            f"the same leading shape; got logits {tuple(logits.shape)}, target "
            f"{tuple(target.shape)}. Flatten both the way F.cross_entropy would take them."
        )
    local = logits.shape[-1]
    start = dist.get_rank(group) * local if group is not None else 0
    # The maximum only steadies the exponentials: no gradient flows through it.
    peak = _all_reduce(logits.detach().amax(-1), "max", group)
    shifted = logits - peak.unsqueeze(-1)
    total = reduce_from(shifted.exp().sum(-1), group)
    mine = (target >= start) & (target < start + local)
    index = torch.where(mine, target - start, torch.zeros_like(target))
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from(torch.where(mine, picked, torch.zeros_like(picked)), group)
    losses = total.log() - target_logit
    kept = target != ignore_index
    losses = torch.where(kept, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / kept.sum()
