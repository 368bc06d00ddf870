"""Containers and plain objects a traced step leaves in Python state, made again after each
call from templates.

A value the body writes is replayed as a *template* (:mod:`.python_effects`). A tuple, list,
dict, ``deque`` or named tuple of written values is a template of its items; so is an object of the
user's own class made in the step (torchvision's ``MetricLogger`` makes a ``SmoothedValue``
meter on its first update, through a ``defaultdict``): made after the call without its
``__init__``, as a copy is, with its attributes built from their templates (an object that
existed before the call stays that object); a value of a type registered with torch's
pytree (transformers' ``ModelOutput``) is made from its leaves. A container of constants
stays the value itself.

Example:
    >>> from collections import defaultdict, deque
    >>> made_template(deque([1, 2], maxlen=3), lambda v: ("const", v))
    ('const', deque([1, 2], maxlen=3))
    >>> build_made(("deque", [("const", 1)], 3), lambda t: t[1], {})
    deque([1], maxlen=3)
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Container
from typing import Any

import torch.utils._pytree as pytree

from ..errors import TraceError, computed_key_error
from .python_location import fields_of
from .python_numbers import unstood
from .python_reach import holds_traced, is_plain_object

__all__ = ["MADE", "build_made", "made_template"]

MADE = frozenset(
    {"tuple", "namedtuple", "list", "dict", "defaultdict", "deque", "object", "pytree"}
)
"""The template kinds of this module."""

Template = tuple


def made_template(
    value: Any,
    template: Callable[[Any], Template],
    known: Container[int] = (),
    cache: dict[int, Template | None] | None = None,
) -> Template | None:
    """The template of ``value`` if it is a container, or a plain object the step made
    (one holding traced values and not among the ``known`` objects, by id, that existed
    before: those are the same object after the call), else ``None``. ``template`` makes
    the items'. With a ``cache`` (one per trace), a value reached twice has one template,
    built into one object after each call, as eager's is one object."""
    cache = {} if cache is None else cache
    if id(value) in cache:
        made = cache[id(value)]
        if made is None:
            raise TraceError(
                f"the step makes a {type(value).__name__} that holds itself, with traced "
                "values inside, which functacc.jit cannot make again after each call. Fix: "
                "make it before the step's first call, or keep the values elsewhere."
            )
        return made
    kind = _kind(value, known)
    if kind is None:
        return None
    cache[id(value)] = None  # being made: a cycle back to it is an error
    extra = _extra(kind, value)
    if kind == "pytree":  # a model's output: its leaves
        leaves, extra = pytree.tree_flatten(value)
        items: Any = [template(v) for v in leaves]
    elif kind in ("dict", "defaultdict", "object"):
        fields = fields_of(value) if kind == "object" else value
        for key in fields if kind != "object" else ():  # {f"q{quartile}": loss}
            if isinstance(key, str) and "\x00functacc" in key:
                raise computed_key_error(key, f"a {type(value).__name__} the step makes")
        items = {k: template(v) for k, v in fields.items()}
    else:
        items = [template(v) for v in value]
    templates = items.values() if isinstance(items, dict) else items
    constant = kind not in ("object", "pytree") and all(t[0] == "const" for t in templates)
    made = ("const", value) if constant else (kind, items, extra)
    cache[id(value)] = made
    return made


def _extra(kind: str, value: Any) -> Any:
    """What making ``value`` again takes beyond its items."""
    if kind == "deque":
        return value.maxlen
    if kind == "defaultdict":  # a defaultdict(float) made while traced: float, not its stand-in
        return unstood(value.default_factory)
    if kind in ("object", "namedtuple"):
        return type(value)
    return None


def _kind(value: Any, known: Container[int]) -> str | None:
    if type(value) in (tuple, list, dict, deque, defaultdict):
        return type(value).__name__
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return "namedtuple"
    if is_plain_object(value) and id(value) not in known and holds_traced(value):
        return "object"
    if pytree._get_node_type(value) in pytree.SUPPORTED_NODES:  # transformers' ModelOutput
        return "pytree"
    return None


def build_made(template: Template, build: Callable[[Template], Any], memo: dict) -> Any:
    """The value a template of :data:`MADE` stands for (``build`` makes its items; ``memo``,
    one per call, makes a template reached twice one object)."""
    made = memo.get(id(template))
    if made is not None:
        return made
    kind, items, extra = template
    if kind in ("tuple", "list", "namedtuple"):
        made = [build(t) for t in items]
        made = extra(*made) if kind == "namedtuple" else tuple(made) if kind == "tuple" else made
    elif kind == "deque":
        made = deque((build(t) for t in items), extra)
    elif kind == "object":
        made = extra.__new__(extra)
        fields_of(made).update({k: build(t) for k, t in items.items()})  # slots too
    elif kind == "pytree":
        made = pytree.tree_unflatten([build(t) for t in items], extra)
    else:
        made = defaultdict(extra) if kind == "defaultdict" else {}
        made.update({k: build(t) for k, t in items.items()})
    memo[id(template)] = made
    return made
