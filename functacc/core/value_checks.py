"""Checks of tensor values that torch makes on the host, asserted in a traced step's graph.

RL and VAE code builds distributions in its step (``Categorical(logits=policy(obs))``,
``Normal(mu, std)``); by default each checks its arguments and samples on the host,
``if not torch._is_all_true(valid): raise ValueError(...)``, a branch on a tensor's value a
graph traced once cannot take (the trace failed, advising ``torch.where``). While a step
body is traced, that check from ``torch.distributions`` is ``torch._assert_async`` of the
same condition: the graph checks it on every call and the call fails (a ``RuntimeError``
naming the check) where eager would raise, before any state is written; a valid call
computes what eager computes. So is ``clip_grad_norm_(..., error_if_nonfinite=True)``'s
check of the total norm, and so are torchmetrics' checks (:mod:`.metric_checks`).

``torch.bincount(x, minlength=n)`` sizes its result on the host, ``max(n, x.max() + 1)``: a
size a graph cannot take from the values (the trace failed where the counts were used, as a
class weight). While traced it is ``n`` counts made in the graph (``index_add_`` in eager's
dtype and order: the same counts, and the same sums of float weights), and the graph asserts
that every value is in ``[0, n)``, where eager's size is ``n`` too; a call with a value
outside fails before it writes any state.

Example:
    >>> import torch
    >>> with value_checks_in_graph():
    ...     torch.distributions.Normal(torch.zeros(2), torch.ones(2)).sample().shape
    torch.Size([2])
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .metric_checks import metric_checks_in_graph

__all__ = ["value_checks_in_graph"]

_MESSAGE = (
    "functacc: a torch.distributions argument or value is outside its constraint or support "
    "(eager raises ValueError here; checked in the graph). Build the distribution from valid "
    "values, or with validate_args=False."
)
_BINCOUNT = (
    "functacc: a value counted by torch.bincount(x, minlength=n) is negative or not below n "
    "(eager returns more than n counts there, or raises; checked in the graph). Make "
    "minlength cover every value, or count after the call."
)
_NONFINITE = (
    "functacc: the total norm of the gradients is non-finite, so it cannot be clipped "
    "(clip_grad_norm_(..., error_if_nonfinite=True); checked in the graph)."
)


@contextlib.contextmanager
def value_checks_in_graph() -> Iterator[None]:
    """While inside: ``torch._is_all_true`` called from ``torch.distributions`` asserts in
    the graph and answers ``True`` (from anywhere else it is torch's own), and
    ``clip_grad_norm_``'s ``error_if_nonfinite`` check is asserted in the graph."""
    from torch.nn.utils import clip_grad

    real, real_total = torch._is_all_true, clip_grad._get_total_norm

    def is_all_true(tensor: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith("torch.distributions"):
            return real(tensor)
        torch._assert_async(real(tensor), _MESSAGE)
        return True

    def total_norm(
        tensors: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False, foreach: Any = None
    ) -> Any:
        norm = real_total(tensors, norm_type, False, foreach)
        if error_if_nonfinite:
            torch._assert_async(norm.isfinite(), _NONFINITE)
        return norm

    torch._is_all_true, clip_grad._get_total_norm = is_all_true, total_norm
    matrices, counts = _matrix_checks_in_graph(), _bincount_in_graph()
    try:
        with metric_checks_in_graph():
            yield
    finally:
        torch._is_all_true, clip_grad._get_total_norm = real, real_total
        matrices()
        counts()


def _bincount_in_graph() -> Any:
    """``torch.bincount`` and ``Tensor.bincount`` with a ``minlength``: that many counts,
    asserted to hold every value (others: torch's own). Returns the undo."""
    real_function, real_method = torch.bincount, torch.Tensor.bincount

    def bincount(input: Any, weights: Any = None, minlength: int = 0) -> Any:
        plain = minlength > 0 and input.dim() == 1 and not input.is_floating_point()
        plain = plain and input.dtype not in (torch.bool, torch.complex64, torch.complex128)
        if weights is not None:  # torch's errors for those (and no gradient to weights)
            plain = plain and weights.shape == input.shape and not weights.requires_grad
        if not plain:
            return real_function(input, weights, minlength)
        torch._assert_async(((input >= 0) & (input < minlength)).all(), _BINCOUNT)
        if weights is None:
            ones = torch.ones_like(input, dtype=torch.int64)
            return input.new_zeros(minlength, dtype=torch.int64).index_add_(0, input, ones)
        dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
        return weights.new_zeros(minlength, dtype=dtype).index_add_(0, input, weights.to(dtype))

    torch.bincount, torch.Tensor.bincount = bincount, bincount  # type: ignore[assignment]

    def undo() -> None:
        torch.bincount, torch.Tensor.bincount = real_function, real_method  # type: ignore

    return undo


def _matrix_checks_in_graph() -> Any:
    """``MultivariateNormal``'s check of its covariance (positive definite: symmetric, then
    Cholesky) returns early on the host where a matrix is not symmetric
    (``if not sym_check.all(): return sym_check``): here the checks are combined in the
    graph, which gives the same verdict. Returns the undo."""
    from torch.distributions import constraints as c

    def symmetric(self: Any, value: Any) -> Any:
        square = c._Square.check(self, value)
        if value.shape[-2] != value.shape[-1]:  # known from the shapes
            return square
        return torch.isclose(value, value.mT, atol=1e-6).all(-2).all(-1)

    tests = {
        c._Symmetric: symmetric,
        c._PositiveDefinite: lambda self, v: (
            symmetric(self, v) & torch.linalg.cholesky_ex(v).info.eq(0)
        ),
        c._PositiveSemidefinite: lambda self, v: (
            symmetric(self, v) & torch.linalg.eigvalsh(v).ge(0).all(-1)
        ),
    }
    real = {cls: vars(cls)["check"] for cls in tests}
    for cls, check in tests.items():
        cls.check = check  # type: ignore[method-assign]

    def undo() -> None:
        for cls, check in real.items():
            cls.check = check  # type: ignore[method-assign]

    return undo
