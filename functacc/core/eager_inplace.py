"""Eager's in-place kernels back in a functionalized graph: the same numbers as eager.

An eager step body is traced with autograd running (the first graph: eager's ops, in-place
ones included), then functionalized, so that its writes into its inputs move to the end of
the graph. Functionalization also turns the in-place ops on intermediate tensors out of
place: ``gates[:, :8].add_(x).sigmoid_()`` (PyTorch's own GRU and LSTM cells, in C++)
becomes ``sigmoid(add(gates[:, :8], x))``. The values are the same, but not always the
bits: the out-of-place ``add`` leaves a contiguous tensor where eager's result stayed in
the strided view, and CPU kernels such as ``sigmoid`` take another (vectorized) path over
a contiguous tensor than over rows of 8 (measured with AVX-512: 3e-8 apart, so a GRU's
gradients left eager's after one step).

:func:`mark_inplace` tags, in the first graph, each in-place pointwise op on a tensor that
is not an input (nor a view of one); the second trace, run node by node with the nodes'
metadata preserved, carries the tag onto the out-of-place op it makes of it;
:func:`restore_inplace` turns those back into the in-place op, on the same operand. That is
safe because eager ran exactly that write: after it, eager reads only the new value, which
the functional graph takes from the op's result, now the operand itself.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

__all__ = ["mark_inplace", "restore_inplace", "traced_node_by_node"]

_TAG = "functacc_inplace"
_getitem = operator.getitem


def _inplace_pointwise(node: Node) -> bool:
    """An in-place pointwise ATen op (``add_``, ``sigmoid_``), which writes its first
    argument and returns it."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    first = schema.arguments[0] if schema.arguments else None
    return (
        torch.Tag.pointwise in target.tags
        and first is not None
        and first.alias_info is not None
        and first.alias_info.is_write
        and target._overloadpacket.__name__.endswith("_")
    )


def _root(node: Any) -> Any:
    """The node whose memory ``node`` views (following view ops and ``getitem`` of ops
    that return several views, such as ``unsafe_split``)."""
    while isinstance(node, Node) and node.op == "call_function":
        target = node.target
        if target is _getitem:
            node = node.args[0]
            continue
        if not isinstance(target, torch._ops.OpOverload):
            return node
        schema = target._schema
        first = schema.arguments[0] if schema.arguments else None
        aliases = first is not None and first.alias_info is not None
        if not aliases or not node.args:
            return node
        node = node.args[0]
    return node


def mark_inplace(gm: GraphModule) -> int:
    """Tag the in-place pointwise ops of ``gm`` that write an intermediate tensor (not an
    input or a view of one); returns how many."""
    marked = 0
    for node in gm.graph.nodes:
        if not _inplace_pointwise(node) or not node.args or not isinstance(node.args[0], Node):
            continue
        root = _root(node.args[0])
        if isinstance(root, Node) and root.op in ("placeholder", "get_attr"):
            continue  # a write into the step's state: functionalization moves it to the end
        node.meta.setdefault("custom", {})[_TAG] = str(node.target)
        marked += 1
    return marked


def traced_node_by_node(gm: GraphModule) -> Callable[..., Any]:
    """``gm`` as a function that runs it through an FX interpreter, so that a trace of it
    (under ``torch.fx.traceback.preserve_node_meta()``) gives each new node the metadata
    of the node it came from."""
    return lambda *args: torch.fx.Interpreter(gm).run(*args)


def restore_inplace(gm: GraphModule) -> int:
    """Turn the out-of-place ops that carry :func:`mark_inplace`'s tag back into eager's
    in-place op on their first argument; returns how many."""
    restored = 0
    for node in list(gm.graph.nodes):
        tag = node.meta.get("custom", {}).get(_TAG)
        if tag is None or node.op != "call_function":
            continue
        inplace = _overload(tag)
        target = node.target
        if (
            inplace is None
            or not isinstance(target, torch._ops.OpOverload)
            or target._overloadpacket.__name__ + "_" != inplace._overloadpacket.__name__
            or target._overloadname != inplace._overloadname
            or not _same_layout(node, node.args[0] if node.args else None)
        ):
            continue
        node.target = inplace
        restored += 1
    if restored:
        gm.recompile()
    return restored


def _same_layout(node: Node, operand: Any) -> bool:
    """Whether ``node``'s result can live in ``operand``'s memory: same shape and dtype
    (an in-place op cannot broadcast its first argument or change its type)."""
    if not isinstance(operand, Node):
        return False
    out, into = node.meta.get("val"), operand.meta.get("val")
    return (
        isinstance(out, torch.Tensor)
        and isinstance(into, torch.Tensor)
        and out.shape == into.shape
        and out.dtype == into.dtype
    )


def _overload(name: str) -> Any:
    """The ATen overload named ``name`` (``"aten.add_.Tensor"``), or ``None``."""
    namespace, packet, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except AttributeError:
        return None
