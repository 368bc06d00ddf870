"""Schedule the gradient collectives of a traced step as early as their inputs allow.

The step function reduces gradients after ``torch.autograd.grad`` returns, so in the traced
graph every all-reduce sits after the whole backward pass. This pass moves each gradient
all-reduce / reduce-scatter (with the pure ops that only build its input) to just after its
inputs are computed, and each ``wait_tensor`` to just before its result is used: the
communication of the last layers' gradients runs while the first layers' gradients are still
being computed, as DDP's bucketed hooks do. All-gathers (ZeRO-3 parameter gathers) are left
where they are: moving them earlier would keep gathered weights alive longer. A collective
never moves above an in-place write into its inputs (a batch norm's running statistics are
written without a data edge in the graph). The pass only reorders; the arithmetic, and so
the results, are unchanged.
"""

from __future__ import annotations

import itertools
import operator

from torch.fx import GraphModule, Node

from .comm import writers

_EARLY = {"all_reduce", "reduce_scatter_tensor"}


def _is_collective(node: Node, names=_EARLY) -> bool:
    return (
        node.op == "call_function"
        and getattr(node.target, "namespace", "") == "_c10d_functional"
        and node.target._opname in names
    )


def _is_wait(node: Node) -> bool:
    return (
        node.op == "call_function"
        and getattr(node.target, "namespace", "") == "_c10d_functional"
        and node.target._opname == "wait_tensor"
    )


# Ops that only assemble a collective's input (flatten, concatenate, scale, cast): they move
# with it. Real compute stays in program order, and the collective follows it closely.
_PREP_OPS = {
    "cat",
    "view",
    "_unsafe_view",
    "reshape",
    "slice",
    "split",
    "split_with_sizes",
    "mul",
    "div",
    "_to_copy",
    "clone",
    "alias",
    "t",
    "permute",
    "expand",
}


def _is_prep_op(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    name = getattr(node.target, "_opname", None)
    schema = getattr(node.target, "_schema", None)
    return name in _PREP_OPS and schema is not None and not schema.is_mutable


def issue_collectives_early(gm: GraphModule) -> int:
    """Move each gradient all-reduce / reduce-scatter (with the pure ops that only prepare
    its input) right after the last node it depends on, and each wait right before its first
    use, so communication overlaps the rest of backward. Returns how many moved."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    prep: set[Node] = set()
    for node in nodes:
        if _is_collective(node):
            prep.add(node)
    # Pure producers whose every user is already in the set are part of the preparation.
    changed = True
    while changed:
        changed = False
        for node in reversed(nodes):
            if node in prep or not _is_prep_op(node) or not node.users:
                continue
            if all(u in prep for u in node.users):
                prep.add(node)
                changed = True
    if not any(_is_collective(n) for n in nodes):
        return 0
    # A moved node reads its inputs only after every earlier in-place write into them.
    after: dict[Node, list[Node]] = {
        n: [
            w
            for a in n.all_input_nodes
            for w in writers(a)
            if w is not n and position[w] < position[n]
        ]
        for n in prep
    }
    order: list[Node] = []
    placed: set[Node] = set()
    pending = sorted(prep, key=position.get)
    waits = {n for n in nodes if _is_wait(n) and n.args and n.args[0] in prep}

    def place(n: Node) -> None:
        """Place ``n`` after its inputs, pulling in (just in time) any not placed yet."""
        if n in placed:
            return
        for a in [*n.all_input_nodes, *after.get(n, ())]:
            place(a)
        order.append(n)
        placed.add(n)

    def available(a: Node) -> bool:
        # A wait whose collective has been issued can be placed when a chain needs it.
        return a in placed or (a in waits and a.args[0] in placed)

    def flush() -> None:
        progress = True
        while progress:
            progress = False
            for n in list(pending):
                if all(available(a) for a in [*n.all_input_nodes, *after[n]]):
                    place(n)
                    pending.remove(n)
                    progress = True

    for node in nodes[:-1]:
        if node in prep or node in waits:
            continue  # issued early by flush(), or waited for just before first use
        place(node)
        if node.op != "placeholder":  # placeholders stay together at the top
            flush()
    flush()
    for n in nodes[:-1]:
        place(n)
    place(nodes[-1])
    assert len(order) == len(nodes), (len(order), len(nodes))
    moved = sum(1 for i, n in enumerate(order) if nodes[i] is not n)
    # Re-link the graph in the new order (output stays last).
    for prev, node in itertools.pairwise(order):
        prev.append(node)
    gm.graph.lint()
    gm.recompile()
    return moved
