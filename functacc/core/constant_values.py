"""Values a traced step may read on the host: a batch argument's, or a tensor made of sizes.

A traced step holds fake tensors; torch code that reads one's values (``nn.Transformer``
asking whether an attention mask is causal, ``pack_padded_sequence`` counting the sequences
that run at each time step) cannot run on them. Two kinds have values at the trace:

- a tensor argument of the call (``batch_values``), or one computed from such arguments
  alone (``torch.sort(lengths)``): its values are read, and the arguments' become part of
  the step's signature (other values: another trace, as eager would take another path);
- a tensor computed only by factory ops (``torch.ones``, ``triu``, ``masked_fill``, ...) from
  no input of the step and no random number, which has one value for every call of the
  graph.

:func:`known_value` computes either for real from the ops traced so far.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, fx

from .failure_sites import call_site

__all__ = ["batch_values", "known_value"]

# The batch tensors of the step being traced (as the trace sees them), their real values,
# and the positions whose values were read (guarded), each with where it was first read.
_BATCH: list[tuple[list[Tensor], list[Tensor], set[int]]] = []


@contextlib.contextmanager
def batch_values(
    traced: list[Tensor], real: list[Tensor], guarded: dict[int, str]
) -> Iterator[None]:
    """While tracing: :func:`known_value` may read the batch tensors (``traced[k]`` stands
    for ``real[k]``); the position of each one read goes into ``guarded``, with the user's
    line that read it (for the reason of a later trace)."""
    _BATCH.append((traced, real, guarded))
    try:
        yield
    finally:
        _BATCH.pop()


def known_value(t: Tensor, computed: bool = False) -> Tensor | None:
    """The value of the traced tensor ``t`` where it is a batch argument (its values then
    part of the signature), the graph computes it from no input at all (a mask made of
    sizes), or, with ``computed``, from batch arguments that are vectors of integers
    (``lengths`` of ``pack_padded_sequence``, sorted by it: a trace per distinct lengths, as
    the packing needs; not from a batch of data, nor for a mask: a trace per call); ``None`` where
    it depends on another input, a random number or a tensor written in place by an op
    outside its computation (and when not tracing).

    Example:
        >>> import torch
        >>> known_value(torch.ones(2)) is None  # not tracing
        True
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    slot = None if mode is None else get_proxy_slot(t, mode.tracer, None)
    if slot is None:
        return None
    traced, real, guarded = _BATCH[-1] if _BATCH else ([], [], {})
    inputs = {}
    for k, b in enumerate(traced):
        placeholder = get_proxy_slot(b, mode.tracer, None)
        # Computed from: a vector of integers (lengths; a column, (batch, 1), counts),
        # not a batch of data, whose values would differ at every call
        # (`(tokens != pad).sum(1)`: a trace per call).
        vector = sum(size > 1 for size in b.shape) <= 1
        lengths = computed and vector and not b.is_floating_point()
        if placeholder is not None and (lengths or b is t):
            inputs[placeholder.proxy.node] = k
    found = _ancestors(slot.proxy.node, inputs)
    if found is None:
        return None
    wanted, sizes = found
    # A symbolic size becomes this call's: the graph then holds for that size only (a
    # guard), as eager's branch on the values holds for it.
    try:
        env: dict[fx.Node, Any] = {n: int(n.meta["val"]) for n in sizes}
    except Exception:  # a size the data decides (unbacked): no value here
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        for node in slot.proxy.node.graph.nodes:  # in the graph's order: inputs first
            if node not in wanted:
                continue
            if node.op == "placeholder":
                if inputs[node] not in guarded:  # where it was first read (a stack walk)
                    guarded[inputs[node]] = call_site()
                env[node] = real[inputs[node]].clone()  # an in-place op must not reach it
            elif node.op == "get_attr":
                env[node] = functools.reduce(getattr, node.target.split("."), mode.tracer.root)
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)
    value = env[slot.proxy.node]
    return value if isinstance(value, Tensor) else None


def _ancestors(
    node: fx.Node, inputs: dict[fx.Node, int]
) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """The nodes ``node`` is computed from, and the symbolic integer sizes among them
    (not followed), or ``None`` where one of them is an input not in ``inputs``, a random
    op or an op of unknown effect, or where a tensor among them (or a view of one) is
    written in place by another op."""
    seen, sizes, todo = set(), set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n in sizes:
            continue
        if isinstance(n.meta.get("val"), torch.SymInt):
            sizes.add(n)
            continue
        seen.add(n)
        if (n.op == "placeholder" and n not in inputs) or (n.op != "placeholder" and not _pure(n)):
            return None
        todo.extend(n.all_input_nodes)
    aliases, todo = set(), list(seen)
    while todo:
        n = todo.pop()
        aliases.add(n)
        for user in n.users:
            if user in seen or user in aliases:
                continue
            if getattr(user.target, "is_view", False) or user.target is operator.getitem:
                todo.append(user)
            elif _mutates(user):
                return None
    return seen, sizes


def _pure(node: fx.Node) -> bool:
    """Whether ``node`` is a constant or an ATen op whose result depends on its
    arguments alone (no random number)."""
    if node.op == "get_attr" or (node.op == "call_function" and node.target is operator.getitem):
        return True  # a constant, or an output of a multi-output op (torch.sort's values)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    return not isinstance(node.meta.get("val"), torch.SymFloat | torch.SymBool)


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write one of its arguments (an in-place op, or one unknown)."""
    schema = getattr(node.target, "_schema", None)
    return node.op != "call_function" or schema is None or schema.is_mutable
