"""Copy a traced graph exactly: to another process as its nodes (not its Python code),
or within this one (:func:`copy_graph`).

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
    >>> same = unpack(pickle.loads(pickle.dumps(pack(gm))))
    >>> same.code == gm.code
    True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate

__all__ = ["PackedGraph", "copy_graph", "pack", "unpack"]


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
        return value

    nodes = [
        (
            n.op,
            n.name,
            plain(n.target),
            map_aggregate(n.args, plain),
            map_aggregate(n.kwargs, plain),
        )
        for n in gm.graph.nodes
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
        return value.resolve() if isinstance(value, _Op) else value

    for op, name, target, args, kwargs in packed.nodes:
        args, kwargs = map_aggregate(args, live), map_aggregate(kwargs, live)
        made[name] = graph.create_node(op, live(target), args, kwargs, name=name)
    gm = GraphModule(packed.attributes, graph)
    gm._tracer_cls, gm.graph._tracer_cls = packed.tracer_cls
    return gm


def _attribute(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def copy_graph(graph: Graph) -> Graph:
    """A copy of ``graph``: new nodes, each with a copy of its ``meta`` dict (the values in
    it shared). ``copy.deepcopy`` of a module also copied every fake tensor and regenerated
    the code: about 0.3 s of a large step's warm start."""
    copied = Graph(tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    copied._codegen = copy.deepcopy(graph._codegen)
    copied.output(copied.graph_copy(graph, {}))
    return copied
