"""The real value of a tensor the step computes from no input: a mask made of its sizes.

A traced step holds fake tensors; torch code that compares one's values (``nn.Transformer``
asking whether an attention mask is causal) cannot run on them. A tensor computed only by
factory ops (``torch.ones``, ``triu``, ``masked_fill``, ...) from no input of the step and
no random number has one value for every call of the graph: it is computed here for real
from the ops traced so far, so the comparison takes eager's branch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx

__all__ = ["constant_value"]


def constant_value(t: Tensor) -> Tensor | None:
    """The value of the traced tensor ``t`` where the graph computes it from no input, no
    random number and no tensor written in place by an op outside its own computation;
    ``None`` elsewhere (and when not tracing).

    Example:
        >>> import torch
        >>> constant_value(torch.ones(2)) is None  # not tracing
        True
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    slot = None if mode is None else get_proxy_slot(t, mode.tracer, None)
    if slot is None:
        return None
    found = _ancestors(slot.proxy.node)
    if found is None:
        return None
    wanted, sizes = found
    # A symbolic size becomes this call's: the graph then holds for that size only (a
    # guard), as eager's branch on the values holds for it.
    try:
        copies: dict[fx.Node, Any] = {n: int(n.meta["val"]) for n in sizes}
    except Exception:  # a size the data decides (unbacked): no value here
        return None
    graph = fx.Graph()
    for node in slot.proxy.node.graph.nodes:  # in the graph's order: inputs first
        if node in wanted:
            copies[node] = graph.node_copy(node, copies.__getitem__)
    graph.output(copies[slot.proxy.node])
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        value = fx.GraphModule(mode.tracer.root, graph)()
    return value if isinstance(value, Tensor) else None


def _ancestors(node: fx.Node) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """The nodes ``node`` is computed from, and the symbolic integer sizes among them
    (not followed), or ``None`` where one of them is an input, a random op or an op of
    unknown effect, or where a tensor among them (or a view of one) is written in place
    by another op."""
    seen, sizes, todo = set(), set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n in sizes:
            continue
        if isinstance(n.meta.get("val"), torch.SymInt):
            sizes.add(n)
            continue
        seen.add(n)
        if n.op == "placeholder" or not _pure(n):
            return None
        todo.extend(n.all_input_nodes)
    aliases, todo = set(), list(seen)
    while todo:
        n = todo.pop()
        aliases.add(n)
        for user in n.users:
            if user in seen or user in aliases:
                continue
            if getattr(user.target, "is_view", False):
                todo.append(user)
            elif _mutates(user):
                return None
    return seen, sizes


def _pure(node: fx.Node) -> bool:
    """Whether ``node`` is a constant or an ATen op whose result depends on its
    arguments alone (no random number)."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    return not isinstance(node.meta.get("val"), torch.SymFloat | torch.SymBool)


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write one of its arguments (an in-place op, or one unknown)."""
    schema = getattr(node.target, "_schema", None)
    return node.op != "call_function" or schema is None or schema.is_mutable
