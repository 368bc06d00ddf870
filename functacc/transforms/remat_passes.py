"""Graph passes of recomputation, on the traced step (after remat's tracing marked each
module call's forward and recomputation nodes: :mod:`.remat`).

- :func:`save_matmuls`: the ``"save_matmuls"`` and ``"selective"`` policies keep matmul
  and convolution results from forward instead of recomputing them;
- :func:`order_recomputation`: keeps each recomputation after the backward that needs it
  is ready, so that a compiler does not hoist it into forward (which would keep the
  activations alive after all).

:class:`Recompute` bundles the trace-time part and the policy's pass for a step body
(``functacc.jit(remat=)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from .remat import FORWARD, RECOMPUTE, rematerialize

__all__ = ["Recompute", "order_recomputation", "save_matmuls"]


@dataclass(frozen=True)
class Recompute:
    """What a traced step body recomputes: the outermost modules of ``classes`` in
    ``model`` (all of the body's modules under one root), under ``policy``.

    Example:
        >>> import torch
        >>> plan = Recompute(torch.nn.Sequential(torch.nn.Linear(2, 2)), frozenset({"Linear"}))
        >>> with plan.active():
        ...     pass  # trace the body here
    """

    model: nn.Module
    classes: frozenset[str]
    policy: str = "full"

    def active(self) -> contextlib.AbstractContextManager[None]:
        """While the body is traced: those modules run under checkpointing."""
        return rematerialize(self.model, self.classes)

    def rewrite(self, gm: GraphModule, batch_inputs: int) -> None:
        """After the trace: the policy's pass (``"full"`` has none); ``batch_inputs``: how
        many of the graph's last inputs are the batch."""
        if self.policy != "full":
            selective = self.policy == "selective"
            save_matmuls(gm, batch_inputs=batch_inputs if selective else None)


# What "save_matmuls" keeps from forward instead of recomputing: the ops that dominate a
# block's compute (their inputs: norms, activations, dropout, are recomputed), each with the
# positions of its matrix operands (addmm's and baddbmm's first argument is the bias).
_OPERANDS = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.baddbmm.default: (1, 2),
    torch.ops.aten.convolution.default: (0, 1),
}
_MATMULS = tuple(_OPERANDS)


def _regions(gm: GraphModule, key: str) -> dict[int, list[Node]]:
    regions: dict[int, list[Node]] = {}
    for n in gm.graph.nodes:
        call = n.meta.get(key)
        if call is not None:
            regions.setdefault(call, []).append(n)
    return regions


def save_matmuls(gm: GraphModule, *, batch_inputs: int | None = None) -> int:
    """The ``"save_matmuls"`` policy: each recomputed matmul or convolution is replaced by
    the same op's result from forward (the k-th of its kind in the module's forward), which
    is then kept until backward; returns how many were replaced.

    Backward still recomputes what the matmuls read (normalisations, activations, dropout),
    which Inductor fuses into the backward's own kernels; the expensive ops run once.

    With ``batch_inputs`` (how many of the graph's last inputs are the batch), the
    ``"selective"`` policy: only matmuls with at most one operand computed from the batch
    are kept (a layer's input times its weights); those of two activations, attention's
    ``q @ k^T`` and ``scores @ v``, are recomputed with the softmax and dropout around them.
    Their results grow with the square of the sequence length while their FLOPs are a small
    part of a layer's: Megatron-LM's "selective activation recomputation".
    """
    on_batch = _computed_from_batch(gm, batch_inputs) if batch_inputs is not None else None
    forward = _regions(gm, FORWARD)
    replaced = 0
    for call, recomputed in _regions(gm, RECOMPUTE).items():
        originals: dict[Any, list[Node]] = {}
        for n in forward.get(call, []):
            if n.target in _MATMULS:
                originals.setdefault(n.target, []).append(n)
        seen: dict[Any, int] = {}
        for n in recomputed:
            if n.target not in _MATMULS:
                continue
            k = seen.get(n.target, 0)
            seen[n.target] = k + 1
            if on_batch is not None and _of_two_activations(n, on_batch):
                continue  # "selective": recompute it
            candidates = originals.get(n.target, [])
            if k >= len(candidates) or not _same_value(candidates[k], n):
                continue  # not the same op sequence: keep the recomputation
            n.replace_all_uses_with(candidates[k])
            replaced += 1
        # Drop what only the replaced matmuls read (pure ops; writes are kept).
        for n in reversed(recomputed):
            if not n.users and n.op == "call_function" and not n.is_impure():
                gm.graph.erase_node(n)
    if replaced:
        gm.recompile()
    return replaced


def _computed_from_batch(gm: GraphModule, batch_inputs: int) -> set[Node]:
    """The nodes whose value depends on the graph's last ``batch_inputs`` inputs."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    reached = set(placeholders[len(placeholders) - batch_inputs :]) if batch_inputs else set()
    for n in gm.graph.nodes:
        if n.op != "placeholder" and any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return reached


def _of_two_activations(node: Node, on_batch: set[Node]) -> bool:
    operands = [node.args[i] for i in _OPERANDS[node.target]]
    return all(isinstance(a, Node) and a in on_batch for a in operands)


def _same_value(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    va = va if isinstance(va, (tuple, list)) else (va,)
    vb = vb if isinstance(vb, (tuple, list)) else (vb,)
    return len(va) == len(vb) and all(
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.shape == y.shape
        and x.dtype == y.dtype
        and x.stride() == y.stride()
        for x, y in zip(va, vb, strict=True)
    )


def order_recomputation(gm: GraphModule) -> int:
    """Keep each recomputation in backward, where the trace put it; returns how many
    forward values were fenced.

    The traced step is one graph, so a compiler sees a recomputation as forward ops that
    read forward values. Inductor schedules and fuses them next to the forward's own
    identical ops (they read the same buffers): measured on the bench Transformer, the
    recomputed attention of every layer ran during forward and stayed alive into backward,
    and remat saved 23% of the step's peak memory instead of 50% (the eager backend, which
    keeps the trace's order). Here each recomputation reads the forward values it needs as
    ``where(a == a, value, value)``, ``a`` one element of the backward op just before it:
    the same bits as ``value`` whatever ``a`` holds (NaN included), but nothing in the
    recomputation can run before that op. Inductor fuses the ``where`` into the kernels that
    read it, so the fence costs a load, not a copy; integer and bool values (dropout masks)
    get an equivalent fence that keeps vector code (``_fence``). (``torch.compile`` gets the
    same effect from compiling forward and backward as separate graphs.)
    """
    nodes = list(gm.graph.nodes)
    regions = _regions(gm, RECOMPUTE)
    position = {n: i for i, n in enumerate(nodes)}
    fenced = 0
    for members in regions.values():
        inside = set(members)
        first = members[0]
        anchor = next(
            (
                n
                for n in reversed(nodes[: position[first]])
                if n.op == "call_function" and n not in inside and _has_elements(n)
            ),
            None,
        )
        if anchor is None:
            continue
        outside = {
            a: None
            for n in members
            for a in n.all_input_nodes
            if a not in inside and a is not anchor and _is_tensor(a) and not _input_view(a)
        }
        if not outside:
            continue
        with gm.graph.inserting_before(first):
            element = anchor
            for _ in range(anchor.meta["val"].dim()):  # a view of the first element
                element = gm.graph.call_function(torch.ops.aten.select.int, (element, 0, 0))
                element.meta["val"] = element.args[0].meta["val"].select(0, 0)
            ready = gm.graph.call_function(torch.ops.aten.eq.Tensor, (element, element))
            ready.meta["val"] = element.meta["val"] == element.meta["val"]
            zeros: dict[torch.dtype, Node] = {}
            for value in outside:
                fence = _fence(gm.graph, ready, value, zeros)
                for n in members:
                    n.replace_input_with(value, fence)
                fenced += 1
    if fenced:
        gm.recompile()
    return fenced


def _fence(graph: torch.fx.Graph, ready: Node, value: Node, zeros: dict) -> Node:
    """``value`` again, computed only once ``ready`` is.

    A float value is read as ``where(ready, value, value)``. An integer or bool one
    (dropout masks kept as ``uint8``) is read as ``value | zero``, ``zero`` a 0 of its dtype
    made from ``ready`` (``ready ^ ready``): Inductor's CPU code turns a float condition into
    a byte mask one element at a time, which made ``where`` on a ``uint8`` mask 7x slower
    than reading the mask (1M elements, ``benchmarks/experiments/fence_read.py``: 1.69 vs 0.24 ms),
    while ``|`` stays vector code. On the bench Transformer this took
    ``remat_policy="selective"`` from 0.80x to 0.95x the stored-activation step's
    throughput (``benchmarks/experiments/remat_attention.py``).
    """
    val = value.meta["val"]
    if val.dtype.is_floating_point or val.dtype.is_complex:
        fence = graph.call_function(torch.ops.aten.where.self, (ready, value, value))
    else:
        if val.dtype not in zeros:
            zero = graph.call_function(torch.ops.aten.bitwise_xor.Tensor, (ready, ready))
            zero.meta["val"] = ready.meta["val"] ^ ready.meta["val"]
            if val.dtype is not torch.bool:
                zero = graph.call_function(
                    torch.ops.aten._to_copy.default, (zero,), {"dtype": val.dtype}
                )
                zero.meta["val"] = zero.args[0].meta["val"].to(val.dtype)
            zeros[val.dtype] = zero
        fence = graph.call_function(torch.ops.aten.bitwise_or.Tensor, (value, zeros[val.dtype]))
    fence.meta["val"] = val
    return fence


def _has_elements(node: Node) -> bool:
    """A tensor with at least one element whatever the batch (no symbolic sizes)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(n, int) and n > 0 for n in val.shape)


def _input_view(node: Node) -> bool:
    """A graph input or a view of one (the parameters as functional_call swaps them in):
    there from the start, so it cannot pull a recomputation forward; copying it would copy
    weights."""
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    return node.op in ("placeholder", "get_attr")


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)
