"""PowerSGD gradient compression (Vogels, Karimireddy & Jaggi, NeurIPS 2019).

Each gradient matrix ``M`` (n x m, convolution kernels flattened to ``out x rest``) is sent
as two thin factors: ``P = M Q`` (n x r) and ``Q = M^T P`` (m x r), one power-iteration
step warm-started from the previous step's ``Q``. What the rank-r approximation misses is
kept as error feedback and added to the next step's gradient, so nothing is lost, only
delayed. Vectors and matrices too small to gain are all-reduced as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .comm import all_reduce, bucketed_all_reduce

__all__ = ["PowerSGD"]


@dataclass(frozen=True, kw_only=True)
class PowerSGD:
    """Low-rank gradient compression with error feedback, for :class:`DataParallel`.

    Example:
        >>> import functacc
        >>> dp = functacc.parallel.DataParallel(
        ...     compression=functacc.parallel.PowerSGD(rank=4, warmup_steps=10))
    """

    rank: int = 4
    """Rank of the approximation: a n x m matrix costs r (n + m) numbers instead of n m."""
    warmup_steps: int = 0
    """Steps of plain all-reduce before compressing (early gradients change fast)."""
    seed: int = 0
    """Seed of the initial Q factors; the same on every rank."""

    def __post_init__(self) -> None:
        if self.rank < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"PowerSGD needs rank >= 1 and warmup_steps >= 0; got rank={self.rank}, "
                f"warmup_steps={self.warmup_steps}"
            )

    def compressible(self, t: Tensor) -> bool:
        if t.dim() < 2:
            return False
        n, m = t.shape[0], t[0].numel()
        return self.rank * (n + m) < n * m

    def init(self, params: Mapping[str, Tensor]) -> dict[str, Any]:
        g = torch.Generator().manual_seed(self.seed)
        q, error = {}, {}
        for name, p in params.items():
            if p.requires_grad and self.compressible(p):
                m = p[0].numel()
                q[name] = torch.randn(m, self.rank, generator=g, dtype=p.dtype).to(p.device)
                error[name] = torch.zeros(p.shape[0], m, dtype=p.dtype, device=p.device)
        return {"q": q, "error": error}

    def signature(self, count: int) -> tuple:
        return ("powersgd", "warmup" if count < self.warmup_steps else "compressing")

    def reduce(
        self,
        grads: dict[str, Tensor],
        state: dict[str, Any],
        *,
        group: Any,
        world: int,
        bucket_bytes: float,
        signature: tuple,
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        matrices = [n for n in grads if n in state["q"]]
        if "warmup" in signature or not matrices:
            return bucketed_all_reduce(
                grads, group, scale=1.0 / world, bucket_bytes=bucket_bytes
            ), state
        plain = {n: g for n, g in grads.items() if n not in state["q"]}
        out = bucketed_all_reduce(plain, group, scale=1.0 / world, bucket_bytes=bucket_bytes)
        m_mats = {n: grads[n].reshape(grads[n].shape[0], -1) + state["error"][n] for n in matrices}
        # All P factors travel in one all-reduce, then all Q factors in another.
        ps = _mean({n: m_mats[n] @ state["q"][n] for n in matrices}, group, world)
        ps = {n: torch.linalg.qr(p).Q for n, p in ps.items()}
        qs = _mean({n: m_mats[n].t() @ ps[n] for n in matrices}, group, world)
        new_q, new_error = dict(state["q"]), dict(state["error"])
        for n in matrices:
            approx = ps[n] @ qs[n].t()
            new_error[n] = m_mats[n] - approx
            new_q[n] = qs[n]
            out[n] = approx.view_as(grads[n])
        return {n: out[n] for n in grads}, {**state, "q": new_q, "error": new_error}


def _mean(tensors: dict[str, Tensor], group: Any, world: int) -> dict[str, Tensor]:
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    flat = all_reduce(flat / world, group)
    pieces = flat.split([t.numel() for t in tensors.values()])
    return {n: p.view_as(t) for (n, t), p in zip(tensors.items(), pieces, strict=True)}
