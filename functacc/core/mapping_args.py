"""A ``collections.UserDict`` argument of a jitted step: its tensors are inputs of the call.

Hugging Face's collators give batches as ``transformers.BatchEncoding``, a ``UserDict``
that torch's pytree does not open: ``step(batch)`` with ``model(**batch)`` inside read the
batch's tensors as constants of the trace (a ``TraceError`` naming a tensor that is none of
the step's inputs, whose advice, to pass it as an argument, it already was). Such an argument
is carried as a pytree node of its own (:func:`carried`): its entries are leaves as a dict's
are, and the body gets an object of the argument's class holding the traced values, with
its other attributes as they were (they must be hashable: they become part of the step's
signature, as a constant argument is).

Example:
    >>> import collections, torch
    >>> import torch.utils._pytree as pytree
    >>> batch = collections.UserDict(x=torch.ones(2))
    >>> (args, kwargs) = carried((batch,), {})
    >>> leaves, spec = pytree.tree_flatten((args, kwargs))
    >>> len(leaves), type(pytree.tree_unflatten(leaves, spec)[0][0]).__name__
    (1, 'UserDict')
"""

from __future__ import annotations

import collections
from typing import Any

import torch.utils._pytree as pytree

__all__ = ["carried"]


class _Carried:
    """A ``UserDict`` argument, as the pytree node :func:`carried` makes of it."""

    __slots__ = ("value",)

    def __init__(self, value: collections.UserDict):
        self.value = value


def carried(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each ``UserDict`` among them (at the top, or inside
    lists, tuples and dicts) made a pytree node whose entries are leaves."""
    if not any(_has_user_dict(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    return pytree.tree_map(
        lambda x: _Carried(x) if isinstance(x, collections.UserDict) else x, (args, kwargs)
    )


def _has_user_dict(value: Any) -> bool:
    if isinstance(value, collections.UserDict):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_user_dict(v) for v in value)
    return isinstance(value, dict) and any(_has_user_dict(v) for v in value.values())


def _context(node: _Carried) -> tuple:
    obj = node.value
    rest = tuple((k, v) for k, v in vars(obj).items() if k != "data")
    try:
        hash(rest)
    except TypeError:
        names = [k for k, v in rest if getattr(type(v), "__hash__", None) is None]
        raise TypeError(
            f"an argument of the step is a {type(obj).__name__} whose attributes {names} "
            "are not hashable: functacc.jit opens its entries as inputs of the call and "
            "keeps the rest as part of the step's signature. Fix: pass its entries as a "
            "dict (dict(batch), or batch.data)."
        ) from None
    return (type(obj), tuple(obj.data), rest)


def _flatten(node: _Carried) -> tuple[list, tuple]:
    return list(node.value.data.values()), _context(node)


def _flatten_with_keys(node: _Carried) -> tuple[list, tuple]:
    keys = [pytree.MappingKey(k) for k in node.value.data]
    return list(zip(keys, node.value.data.values(), strict=True)), _context(node)


def _unflatten(values: Any, context: tuple) -> collections.UserDict:
    cls, keys, rest = context
    made = cls.__new__(cls)
    vars(made).update(dict(rest))
    made.data = dict(zip(keys, values, strict=True))
    return made


pytree.register_pytree_node(
    _Carried,
    _flatten,
    _unflatten,
    serialized_type_name="functacc.core.mapping_args._Carried",
    flatten_with_keys_fn=_flatten_with_keys,
)
