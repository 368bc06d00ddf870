"""``opt.state`` read by a step body outside ``opt.step()``, for functacc's twin of SGD, Adam
and AdamW.

While a body is traced, those optimizers step through their pure twin
(:class:`~.optimizers.TracedOptimizer`), whose state is the graph's, not ``opt.state``'s.
A body that reads ``opt.state[p]`` itself (a log of Adam's ``exp_avg``, the step count)
gets :class:`TracedStateView`'s entries: the twin's traced tensors, named as torch names
them, where eager has them (the parameter stepped at an earlier call or earlier in this
one), so the values are eager's. A write there (a wrapper keeping its own entry,
schedulefree's ``ScheduleFreeWrapper``: ``state["z"] = p.clone()``) is an error: the
twin would not carry it to the next call. Before 2026-11-29 the read was a ``KeyError``
about a fake tensor, and the write went into the real dict under a tensor of the trace,
silently (a wrong model, then ``opt.state_dict()`` failing).

Example:
    >>> import torch
    >>> p = torch.zeros(2)  # a parameter's stand-in while traced
    >>> view = TracedStateView({}, {id(p): "w"}, lambda name: {"step": torch.tensor(1.0)})
    >>> p in view, view[p]["step"]
    (True, tensor(1.))
    >>> view[p]["z"] = p.clone()
    Traceback (most recent call last):
    ...
    ValueError: the step writes opt.state[w]['z'] outside opt.step(). ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import argument_error
from .python_location import Location, Root

__all__ = ["TracedStateView", "state_view"]


def state_view(traced: Any, real: dict) -> dict:
    """``real`` (an optimizer's ``state``) as the body of ``traced`` (a
    :class:`~.optimizers.TracedOptimizer`) reads it outside ``step()`` (under ZeRO, where
    each rank keeps shards, ``real`` as it is)."""
    linked = traced.linked
    if linked.sharding is not None:
        return real

    def entries(name: str) -> dict:  # eager has them once the parameter stepped
        if name in traced.stepped:  # earlier in this call
            return linked.link.entries(traced.state, name)
        if traced.python is not None:  # at an earlier call: a guard (a new answer retraces)
            traced.python.guard(Location(_installed(linked, name)), name in linked.installed)
        return linked.link.entries(traced.state, name) if name in linked.installed else {}

    leaves = {id(traced.leaf_of(n)): n for n in linked.link.params}
    return TracedStateView(real, leaves, entries)


def _installed(linked: Any, name: str) -> Root:
    """Whether ``name``'s state is in ``opt.state`` (it stepped at an earlier call), read
    before each call: one root per parameter, kept, so that a guard on it is one guard."""
    roots = vars(linked).setdefault("_installed_roots", {})
    if name not in roots:
        label = f"{name!r} in {linked.label}.state"
        roots[name] = Root(label, lambda: name in linked.installed, None)
    return roots[name]


class TracedStateView(dict):
    """The optimizer's ``state`` while its body is traced: the real entries (functacc's own
    walks see those), and for a parameter of the trace its traced entries."""

    def __init__(self, real: dict, names: dict[int, str], entries: Callable[[str], dict]):
        super().__init__(real)
        self._names = names  # id(traced parameter) -> its name
        self._entries = entries  # name -> {"exp_avg": tensor, ...}, or {} before its step

    def __getitem__(self, key: Any) -> Any:
        name = self._names.get(id(key))
        if name is None:
            return dict.get(self, key, {})  # a defaultdict(dict), as torch's
        return _Entries(self._entries(name), name)

    def __contains__(self, key: Any) -> bool:
        name = self._names.get(id(key))
        return dict.__contains__(self, key) if name is None else bool(self._entries(name))

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default  # noqa: SIM401 (self.get is this)

    def __setitem__(self, key: Any, value: Any) -> None:
        _refuse(self._names.get(id(key), "a parameter"), None)


class _Entries(dict):
    """One parameter's state entries, read only."""

    def __init__(self, entries: dict, name: str):
        super().__init__(entries)
        self._name = name

    def __setitem__(self, key: Any, value: Any) -> None:
        _refuse(self._name, key)

    def __delitem__(self, key: Any) -> None:
        _refuse(self._name, key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else _refuse(self._name, key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        _refuse(self._name, next(iter(dict(*args, **kwargs)), None))

    def pop(self, key: Any, *default: Any) -> Any:
        _refuse(self._name, key)

    def clear(self) -> None:
        _refuse(self._name, None)


def _refuse(name: str, key: Any) -> Any:
    entry = f"[{key!r}]" if key is not None else ""
    raise argument_error(
        f"the step writes opt.state[{name}]{entry} outside opt.step(). functacc steps "
        "torch.optim.SGD, Adam and AdamW through its own pure update, whose state lives in "
        "the graph; an entry written beside it would not be carried to the next call as "
        "eager carries it. Fix: keep that tensor yourself (a module buffer, or a dict by "
        "parameter name the step reads), or read opt.state after the call; reading "
        "opt.state[p] inside the step gives eager's values."
    )
