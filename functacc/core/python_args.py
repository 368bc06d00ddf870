"""The call's Python-number and object arguments: guarded, then fed once they change.

``step(x, y, it)`` with the iteration as an argument was a constant of the graph: each new
value traced the body again (about a second a call for a small model, for ever). The
numbers among a call's arguments (not ``bool``) are roots of the body's Python state
(:mod:`.python_state`), as a closure's numbers are: the first trace bakes them in and
guards them; one that has changed is fed to the graph from then on, read afresh on every
call; one the body branches on (``if it % 100 == 0``) is guarded for good, each value a
trace as before. An object argument (ignite's ``update(engine, batch)``, a trainer) is a
root too: what the body reads and writes through it is followed as through a closure's.

Example:
    >>> import torch.utils._pytree as pytree
    >>> roots, call = [], ((1.0, 3, True), {})
    >>> args = NumberArguments(lambda x, it, flag: None, roots)
    >>> args.bind(*pytree.tree_flatten(call), *call)  # a flag is a constant, by its value
    (('number', 'float'), ('number', 'int'), (<class 'bool'>, True))
    >>> roots[1].label, roots[1].get()
    ('argument it', 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from .python_location import MISSING, Root
from .python_reach import is_plain_object

__all__ = ["NumberArguments", "is_number"]


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` (``np.float64`` too), not a ``bool``: as the state's numbers."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class NumberArguments:
    """The roots standing for the current call's number arguments, by position."""

    def __init__(self, fn: Callable[..., Any], roots: list[Root]):
        self.fn = fn
        self.leaves: list = []  # the current call's flattened arguments
        self.roots = roots  # the body's Python state's: new ones are added there
        self._by_position: dict[int, Root] = {}
        self._top: dict[Any, set[int]] = {}  # by the arguments' tree structure

    def bind(self, leaves: list, spec: Any, args: tuple, kwargs: dict) -> tuple:
        """A call's arguments (flattened: ``leaves``, ``spec``), as a key part: tensors as
        ``None``, constants by value, numbers passed as arguments themselves by type: their
        values are the Python state's to guard or feed. Numbers inside a container (a list
        of sequence lengths) stay constants: they are sizes more often than not."""
        self.leaves = leaves
        key: list[Any] = []
        for i, x in enumerate(leaves):
            if isinstance(x, Tensor):
                key.append(None)
            elif is_number(x) and i in self._top_level(spec, args, kwargs):
                if i not in self._by_position:
                    self._root(i, leaf_name(self.fn, args, kwargs, i))
                key.append(("number", type(x).__name__))
            elif is_plain_object(x) and i in self._top_level(spec, args, kwargs):
                # ignite's update(engine, batch) reads engine.state.iteration: the object
                # is followed as a closure's is (its numbers guarded or fed, writes replayed)
                if i not in self._by_position:
                    self._root(i, leaf_name(self.fn, args, kwargs, i))
                key.append(("object", type(x).__qualname__))
            else:
                key.append(_constant(x))
        return tuple(key)

    def _top_level(self, spec: Any, args: tuple, kwargs: dict) -> set[int]:
        if spec not in self._top:
            paths = pytree.tree_flatten_with_path((args, kwargs))[0]
            self._top[spec] = {i for i, (path, _) in enumerate(paths) if len(path) == 2}
        return self._top[spec]

    def _root(self, i: int, name: str) -> None:
        def get() -> Any:
            return self.leaves[i] if i < len(self.leaves) else MISSING

        def set_(value: Any) -> None:
            self.leaves[i] = value

        root = Root(f"argument {name}", get, set_)
        self._by_position[i] = root
        self.roots.append(root)


def _constant(x: Any) -> Any:
    from .signature import hashable_constant

    return hashable_constant(x)


def leaf_name(fn: Callable[..., Any], args: tuple, kwargs: dict, i: int) -> str:
    """The name of the ``i``-th leaf of a call's flattened arguments: the body's parameter
    (``it``), its keyword, or ``args[k]``, with the path inside (``cfg['lr']``)."""
    from .signature import positional_names

    path = pytree.tree_flatten_with_path((args, kwargs))[0][i][0]
    top, rest = path[1], pytree.keystr(path[2:])
    if path[0].idx == 1:  # a keyword
        return f"{top.key}{rest}"
    names = positional_names(fn)
    return (names[top.idx] if top.idx < len(names) else f"args[{top.idx}]") + rest
