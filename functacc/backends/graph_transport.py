"""Send a traced graph to another process exactly: its nodes, not its Python code.

Pickling a ``GraphModule`` sends its generated code, and unpickling re-traces that code
symbolically. That is not the same graph: an op with no traced input (``empty``, ``full``)
runs while the code is re-traced, and its result is baked in as a constant, so a dropout
mask drawn by ``empty(...).bernoulli_(p)`` became one fixed mask; and every node is renamed
(Inductor's cache keys read the names). :func:`pack` keeps the graph as its list of nodes
(op, name, target, arguments), ATen operators by name, so that :func:`unpack` rebuilds the
same graph under the same names.

Example:
    >>> import pickle, torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: x * torch.empty(3).bernoulli_(0.5))(torch.ones(3))
    >>> copy = unpack(pickle.loads(pickle.dumps(pack(gm))))
    >>> copy.code == gm.code
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

__all__ = ["PackedGraph", "pack", "unpack"]


@dataclass(frozen=True)
class _Ref:
    name: str  # a node of the same graph


@dataclass(frozen=True)
class _Op:
    """An operator overload (``torch.ops.<namespace>.<name>.<overload>``) by name: the
    objects themselves do not pickle."""

    namespace: str
    name: str
    overload: str

    def resolve(self) -> Any:
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)


@dataclass
class PackedGraph:
    nodes: list[tuple[str, str, Any, Any, Any]]  # op, name, target, args, kwargs
    attributes: dict[str, Any]  # what get_attr nodes read (constant tensors)
    tracer_cls: tuple[Any, Any]  # the module's and the graph's (AOTAutograd's key reads it)


def pack(gm: GraphModule) -> PackedGraph:
    """``gm`` as plain data that pickles (see the module docstring)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Node):
            return _Ref(value.name)
        if isinstance(value, torch._ops.OpOverload):
            return _Op(value.namespace, value._opname, value._overloadname)
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(plain(value.start), plain(value.stop), plain(value.step))
        return value

    nodes = [
        (n.op, n.name, plain(n.target), plain(n.args), plain(n.kwargs)) for n in gm.graph.nodes
    ]
    attributes = {n.target: _attribute(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return PackedGraph(nodes, attributes, (gm._tracer_cls, gm.graph._tracer_cls))


def unpack(packed: PackedGraph) -> GraphModule:
    """The graph :func:`pack` packed, same nodes, same names."""
    graph = Graph()
    made: dict[str, Node] = {}

    def live(value: Any) -> Any:
        if isinstance(value, _Ref):
            return made[value.name]
        if isinstance(value, _Op):
            return value.resolve()
        if isinstance(value, (list, tuple)):
            return type(value)(live(v) for v in value)
        if isinstance(value, dict):
            return {k: live(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(live(value.start), live(value.stop), live(value.step))
        return value

    for op, name, target, args, kwargs in packed.nodes:
        node = graph.create_node(op, live(target), live(args), live(kwargs), name=name)
        made[name] = node
    gm = GraphModule(packed.attributes, graph)
    gm._tracer_cls, gm.graph._tracer_cls = packed.tracer_cls
    return gm


def _attribute(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
