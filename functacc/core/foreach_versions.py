"""Version counters for the in-place foreach ops of a traced step body.

Eager PyTorch bumps a tensor's version counter on every in-place write, ``torch._foreach_*_``
included. While ``make_fx`` traces, a foreach op's in-place write leaves the counters as they
were (a plain ``mul_`` still bumps them), so a check of whether the body wrote a tensor since
functacc made it — ZeRO-2's gradients (:mod:`functacc.parallel.jit_grads`) — would miss
``torch._foreach_mul_(grads, scale)``, which ``clip_grad_norm_`` runs with ``foreach=True``
(its default on CUDA). :class:`ForeachVersions` bumps them as eager does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["ForeachVersions"]


class ForeachVersions(TorchFunctionMode):
    """While active, every in-place ``torch._foreach_*_`` op bumps the version counters of
    the tensors it writes (its first argument).

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> with ForeachVersions():
        ...     _ = torch._foreach_add_([t], 1.0)
        >>> t._version >= 1
        True
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_") and name.endswith("_") and args:
            written = [t for t in args[0] if isinstance(t, Tensor)]
            if written:
                torch.autograd.graph.increment_version(written)
        return out
