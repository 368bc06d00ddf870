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
    >>> with memoized_uncached([globals()], []):
    ...     _ = ones(3)
    >>> ones.cache_info().currsize
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from .python_reach import MEMOIZED, is_user_code

__all__ = ["memoized_uncached"]


@contextlib.contextmanager
def memoized_uncached(scopes: Sequence[dict], modules: Sequence[nn.Module]) -> Iterator[None]:
    """While inside: the memoized functions among ``scopes`` (module globals) and the
    attributes of the user's classes of ``modules`` (a method under ``@lru_cache``) are
    their wrapped functions."""
    classes = {c for m in modules for sub in m.modules() for c in type(sub).__mro__}
    owners: list[Any] = [*scopes, *(c for c in classes if is_user_code(c))]
    found = []
    for owner in owners:
        table = owner if isinstance(owner, dict) else vars(owner)
        found += [(owner, k, v) for k, v in list(table.items()) if isinstance(v, MEMOIZED)]
    try:
        for owner, name, memoized in found:
            _set(owner, name, memoized.__wrapped__)
        yield
    finally:
        for owner, name, memoized in found:
            _set(owner, name, memoized)


def _set(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:  # a class: its attribute table is read-only
        setattr(owner, name, value)
