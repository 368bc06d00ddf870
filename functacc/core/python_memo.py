"""Memoized functions (``functools.lru_cache``, ``functools.cache``) run uncached while a
step is traced.

A cache keeps what a call returned. Filled while the step is traced, it would keep the
trace's fake tensor (``@lru_cache def causal_mask(n)``), handed afterwards to eager code
and to the next trace, where eager's cache holds a real tensor; filled before, it hands
the trace a real tensor that is none of the step's inputs (an error). So while a step is
traced, each memoized function of the modules whose code it runs (their globals, the
user's module classes) is its ``__wrapped__`` function: its ops join the graph and are
computed on every call from the same arguments, the value eager's cache returns, and the
cache is left as it was. A memoized function reached only through an installed library's
code is not seen (as that code's other state is not).

Example:
    >>> import functools, torch
    >>> @functools.lru_cache
    ... def ones(n):
    ...     return torch.ones(n)
    >>> with memoized_uncached([globals()]):
    ...     _ = ones(3)
    >>> ones.cache_info().currsize
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..errors import TraceError
from .python_reach import MEMOIZED, is_user_code

__all__ = ["memo_owners", "memoized_uncached"]


def memo_owners(scopes: Sequence[dict], modules: Sequence[nn.Module]) -> list[Any]:
    """Where :func:`memoized_uncached` looks: ``scopes`` (module globals) and the user's
    classes of ``modules``. Found before the body's Python is recorded: ``modules()``
    hashes each module, and a torchmetrics ``Metric``'s hash reads its list states."""
    classes = {c for m in modules for sub in m.modules() for c in type(sub).__mro__}
    return [*scopes, *(c for c in classes if is_user_code(c))]


@contextlib.contextmanager
def memoized_uncached(owners: Sequence[Any]) -> Iterator[None]:
    """While inside: the memoized functions among ``owners`` (module globals, classes: a
    method under ``@lru_cache``; see :func:`memo_owners`) are their wrapped functions. A
    tensor one of them returned that the step then writes in place is a
    :class:`TraceError` on leaving: eager's cache hands the same tensor to every call, so
    the write would carry over between calls, which an uncached call cannot do."""
    found = []
    for owner in owners:
        table = owner if isinstance(owner, dict) else vars(owner)
        found += [(owner, k, v) for k, v in list(table.items()) if isinstance(v, MEMOIZED)]
    returned: list[tuple[str, Tensor, int]] = []
    try:
        for owner, name, memoized in found:
            _set(owner, name, _uncached(memoized, returned))
        yield
    finally:
        for owner, name, memoized in found:
            _set(owner, name, memoized)
    written = next((name for name, t, version in returned if t._version != version), None)
    if written is not None:
        raise TraceError(
            f"the step writes in place into a tensor that the memoized function {written}() "
            "returned: eager's cache gives every call that same tensor, so the write carries "
            "over to the next call, and functacc.jit runs the function uncached while "
            "tracing (its cache would keep the trace's stand-in). Fix: keep that tensor in a "
            "module's buffer (register_buffer) or a variable the step reads, not in a cache."
        )


def _uncached(memoized: Any, returned: list[tuple[str, Tensor, int]]) -> Any:
    """The function ``memoized`` caches, noting the tensors it returns with their version."""
    function = memoized.__wrapped__

    def uncached(*args: Any, **kwargs: Any) -> Any:
        out = function(*args, **kwargs)
        name = getattr(function, "__qualname__", "?")
        returned.extend((name, t, t._version) for t in pytree.tree_leaves(out) if _t(t))
        return out

    return uncached


def _t(value: Any) -> bool:
    return isinstance(value, Tensor)


def _set(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:  # a class: its attribute table is read-only
        setattr(owner, name, value)
