"""Whether an optimizer's ``state`` still holds what a jitted step left there.

A jitted step keeps its optimizers' state tensors as the graph's inputs and updates them in
place, so ``opt.state`` shows eager's values. Code between calls may change that dict in
place, though: ``opt.state.clear()`` or ``del opt.state[p]`` to restart an optimizer (eager's
next ``step()`` then starts that parameter's state afresh), or an entry replaced
(``state["exp_avg"] = torch.zeros_like(...)``).
Before each call the step compares, by identity, the per-parameter dicts and their tensors
with what it saw after the last call; a difference makes it read the state again, as after
``load_state_dict()``. Per call one C++ check that none of those dicts was written since
(:func:`~.guards.model_guard`'s dict versions: a few microseconds); only where one was (an
optimizer whose step writes a number there, ``state["step"] = n``, or a change) are the
tensors compared, in C (``map`` over ``operator.is_``: about 0.3 µs a parameter of Adam).

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    >>> p.grad = torch.ones(2); opt.step()
    >>> seen = StateSeen(opt.state)
    >>> seen.holds(opt.state), opt.state.clear(), seen.holds(opt.state)
    (True, None, False)
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from itertools import chain, compress

from torch import Tensor

from .guards import model_guard

__all__ = ["StateSeen"]


class StateSeen:
    """The per-parameter dicts of ``state`` and their tensor entries, as they are now;
    :meth:`holds` says whether a state dict still holds those."""

    def __init__(self, state: dict):
        self._take(state)

    def _take(self, state: dict) -> None:
        self.state = state
        self._guard = None  # built at the first check that passes
        # Values in order, not looked up by parameter or key: each lookup would be a Python
        # call (a tensor's hash is one); this way the whole check runs in C.
        self.dicts = list(state.values())
        self.sizes = list(map(len, self.dicts))
        self.keys = [k for d in self.dicts for k in d]
        self.values = list(_entries(self.dicts))
        # Only tensors are compared: numbers (a third party's state["step"]) are replaced
        # by every call's write-back and followed as Python values.
        self.tensors = [isinstance(v, Tensor) for v in self.values]

    def holds(self, state: dict) -> bool:
        """Whether ``state`` is the dict seen, with the same per-parameter dicts and the
        same tensor objects under the same keys (entries added to them are no change: a
        step creating more state, as Lookahead's first slow update does)."""
        if state is not self.state:
            return False
        if self._guard is not None and self._guard.passes():
            return True  # no dict written since the tensors were last compared
        if len(state) != len(self.dicts):
            return False
        if not all(map(operator.is_, state.values(), self.dicts)):
            return False
        if list(map(len, self.dicts)) == self.sizes and all(
            compress(map(operator.is_, _entries(self.dicts), self.values), self.tensors)
        ):
            self._guard = model_guard([], [], [state, *self.dicts])
            return True
        owners = [d for d, n in zip(self.dicts, self.sizes, strict=True) for _ in range(n)]
        kept = zip(owners, self.keys, self.values, self.tensors, strict=True)
        if all(d.get(k, _GONE) is v for d, k, v, tensor in kept if tensor):
            self._take(state)
            return True
        return False


_GONE = object()


def _entries(dicts: list[dict]) -> Iterator:
    return chain.from_iterable(map(dict.values, dicts))
