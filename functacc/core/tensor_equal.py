"""``torch.equal`` in a traced step: answered at the trace, checked in the graph.

Eager code branches on ``torch.equal(a, b)``: sgrvinod's Transformer tutorial decides
whether an attention layer is self-attention with
``self_attention = torch.equal(key_value_sequences, query_sequences)``, then normalizes the
keys only if so. The answer is a Python bool of the tensors' values, which a trace does not
have. While a step is traced, :class:`EqualAtTrace` answers it the way eager's values would,
and where that answer rests on values, the graph checks it on every call
(``torch._assert_async``, before any state is written: the call fails with a
``RuntimeError`` naming the call site where eager would have branched the other way):

- other shapes: ``False``, as eager (no check needed);
- values known at the trace (:func:`~.constant_values.known_value`): eager's answer;
- the same tensor twice (the self-attention above): ``True``, checked to hold no NaN
  (``torch.equal(x, x)`` is ``False`` in eager where ``x`` holds a NaN);
- two different tensors of one shape (the cross-attention, where the two lengths match):
  ``False``, checked: equal values by chance fail the call.

Example:
    >>> import torch
    >>> with EqualAtTrace():  # not tracing: torch's own
    ...     torch.equal(torch.ones(2), torch.ones(2))
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from .constant_values import known_value
from .failure_sites import call_site

__all__ = ["EqualAtTrace"]

_EQUALS = frozenset({torch.equal, Tensor.equal})


class EqualAtTrace(TorchFunctionMode):
    """While tracing: ``torch.equal`` / ``Tensor.equal`` of traced tensors answered (see the
    module); of real tensors, torch's own."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _EQUALS or len(args) != 2:
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # looked at without the other modes
            if not _traced(args):
                return func(*args, **kwargs)
            a, b = args
            if a.shape != b.shape:
                return False
            known = [known_value(t, computed=True) for t in (a, b)]
            floating = a.is_floating_point() or a.is_complex()
        if known[0] is not None and known[1] is not None:
            with _disable_current_modes():  # real tensors: eager's answer
                return func(*known)
        site = call_site()
        if a is b:
            if floating:
                torch._assert_async(
                    a.isnan().any().logical_not(),
                    f"functacc: torch.equal(x, x) at {site} is False in eager this call "
                    "(x holds a NaN), so eager takes the other branch; the graph was traced "
                    "with True. Check the values for NaN before the branch, or compare "
                    "without torch.equal (a flag of your own says which call this is).",
                )
            return True
        torch._assert_async(
            a.eq(b).all().logical_not(),
            f"functacc: torch.equal(a, b) at {site} is True this call, and the graph was "
            "traced with False: two different tensors of the step can hold equal values only "
            "by chance, which functacc cannot know when it traces. Decide the branch without "
            "the values (a flag of your own, a comparison of shapes or of `a is b`), or "
            "keep both results and pick with torch.where(flag, x, y).",
        )
        return False


def _traced(args: tuple) -> bool:
    """Whether a trace is running and one of ``args`` is one of its tensors."""
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(t, Tensor) and is_fake(t) for t in args)
