"""``torch.distributions``' argument checks in a traced step: asserted in the graph.

RL and VAE code builds distributions in its step (``Categorical(logits=policy(obs))``,
``Normal(mu, std)``); by default each checks its arguments and samples on the host,
``if not torch._is_all_true(valid): raise ValueError(...)``, a branch on a tensor's value a
graph traced once cannot take (the trace failed, advising ``torch.where``). While a step
body is traced, that check from ``torch.distributions`` is ``torch._assert_async`` of the
same condition: the graph checks it on every call and the call fails (a ``RuntimeError``
naming the check) where eager would raise, before any state is written; a valid call
computes what eager computes.

Example:
    >>> import torch
    >>> with distribution_checks_in_graph():
    ...     torch.distributions.Normal(torch.zeros(2), torch.ones(2)).sample().shape
    torch.Size([2])
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["distribution_checks_in_graph"]

_MESSAGE = (
    "functacc: a torch.distributions argument or value is outside its constraint or support "
    "(eager raises ValueError here; checked in the graph). Build the distribution from valid "
    "values, or with validate_args=False."
)


@contextlib.contextmanager
def distribution_checks_in_graph() -> Iterator[None]:
    """While inside: ``torch._is_all_true`` called from ``torch.distributions`` asserts in
    the graph and answers ``True``; from anywhere else it is torch's own."""
    real = torch._is_all_true

    def is_all_true(tensor: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith("torch.distributions"):
            return real(tensor)
        torch._assert_async(real(tensor), _MESSAGE)
        return True

    torch._is_all_true = is_all_true
    try:
        yield
    finally:
        torch._is_all_true = real
