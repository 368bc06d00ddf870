"""Python numbers of a traced step read from the batch: ``lengths.tolist()`` and the like.

Eager code turns a batch's integer vector into Python numbers and loops or sizes with them:
sgrvinod's image-captioning decoder sorts ``caption_lengths``, takes
``decode_lengths = (caption_lengths - 1).tolist()``, sizes its outputs with
``max(decode_lengths)`` and runs ``sum([l > t for l in decode_lengths])`` sequences at time
step ``t``. A trace holds fake tensors, whose ``.tolist()`` gives symbols without values,
and the first size or branch made of one fails.

When a trace fails that way, :func:`~.tracer.trace` traces again under
:class:`ValuesOnHost`: ``.tolist()``, ``.item()``, ``int()``, ``float()``, ``bool()`` and
``operator.index`` of a tensor whose values are known at the trace give its real values:
a vector or a number of integers (not a batch of data) that is a batch argument or is
computed from such arguments alone (:func:`~.constant_values.known_value`). Those
arguments' values join the call's signature, so other ``lengths`` trace again, as eager
runs another loop; a step that traced without reading them (``n = lengths.sum().item()``
only returned) keeps its symbols and its one graph.

Example:
    >>> import torch
    >>> with ValuesOnHost():  # not tracing: nothing is known, the plain read runs
    ...     torch.tensor([3, 2]).tolist()
    [3, 2]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from .constant_values import known_value

__all__ = ["ValuesOnHost"]

# The reads of a tensor's values as Python numbers.
_READS = frozenset(
    {
        Tensor.tolist,
        Tensor.item,
        Tensor.__int__,
        Tensor.__index__,
        Tensor.__float__,
        Tensor.__bool__,
    }
)


class ValuesOnHost(TorchFunctionMode):
    """While tracing: a read of a known tensor's values as Python numbers gives them (see
    the module); other reads and every other op run as they would. With ``read=False`` it
    only notes in ``known_reads`` that there were such reads: a trace that failed without
    them is worth another only then."""

    def __init__(self, read: bool = True) -> None:
        super().__init__()
        self.read = read
        self.known_reads = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        value = None
        if func in _READS and args:
            # Looked at without the other modes (HostPacking would see .shape of its tensors)
            with torch._C.DisableTorchFunction():
                value = known_value(args[0], computed=True) if _numbers(args[0]) else None
        if value is not None:
            self.known_reads += 1
            if self.read:
                with _disable_current_modes():  # a real tensor: eager's own read
                    return func(value, *args[1:], **kwargs)
        return func(*args, **kwargs)


def _numbers(t: Any) -> bool:
    """Whether ``t`` may be read here: a vector (or a number) of integers or bools, as
    lengths and counts are; not a batch of data, whose values change every call (a trace
    per call)."""
    return (
        isinstance(t, Tensor)
        and not t.is_floating_point()
        and not t.is_complex()
        and sum(size > 1 for size in t.shape) <= 1
    )
