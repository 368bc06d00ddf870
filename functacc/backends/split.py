"""Compile the optimizer update apart from forward and backward, once for every shape.

The traced step is one graph, but Inductor compiles it as two: *gradients* (forward, loss,
backward, gradient collectives, clipping) and *update* (the optimizer and every write to
the state). The update sees only tensors shaped like the parameters, so it is the same graph
whatever the batch's shape: rebuilt with canonical node names, it hits Inductor's graph
cache on every retrace (a new bucket, a symbolic retrace, a second process), and a retrace
compiles only forward and backward, as ``torch.compile`` recompiles only the model.

The step function marks the boundary with :func:`mark_optimizer_inputs` (the gradients as
the optimizer will read them); :func:`split_at_optimizer` cuts the graph there.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..core.graph_passes import has_effect, live_nodes

__all__ = ["Split", "mark_optimizer_inputs", "split_at_optimizer"]


@torch.library.custom_op("functacc::optimizer_inputs", mutates_args=())
def _optimizer_inputs(tensors: list[Tensor]) -> list[Tensor]:
    # Only ever traced: the split removes it (and so does the eager backend).
    return [t.clone() for t in tensors]


@_optimizer_inputs.register_fake
def _(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(t) for t in tensors]


MARKER = torch.ops.functacc.optimizer_inputs.default


def mark_optimizer_inputs(tensors: list[Tensor]) -> list[Tensor]:
    """Mark where the update starts: ``tensors`` are everything it takes from backward.
    Outside a trace this is the identity."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if not tensors or get_proxy_mode() is None:
        return tensors
    return list(_optimizer_inputs(tensors))


def remove_marker(gm: GraphModule) -> None:
    """Let the marked tensors flow straight through (one graph, no split)."""
    markers = list(gm.graph.find_nodes(op="call_function", target=MARKER))
    for node in markers:
        for user in list(node.users):
            user.replace_all_uses_with(node.args[0][user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    if markers:
        gm.recompile()


@dataclass
class Split:
    """The two graphs and how to wire them: ``gradients`` takes the step's inputs, then
    ``slots``, and returns the other values ``update`` needs (``carried``) and the step's
    outputs it computes; ``update`` takes ``carried``, the slots, then the step inputs
    listed in ``update_inputs``.

    The slots are 1-D tensors, one per dtype, allocated once, that the gradients graph
    writes its scalars for the update into (AdamW's step counts, step sizes and bias
    corrections), each at its own index; the update reads them back with ``select``.
    Returned, each scalar was a tensor allocated on every call and one more kernel argument:
    on the bench MLP (59 scalars; 2-core CPU, ``benchmarks/experiments/step_breakdown.py``)
    1.00 ms a step, 0.95 ms with a 0-dim slot each; one slot for all 59 (the update's inputs
    150 -> 93) within the noise of that (0.918 vs 0.914 ms, interleaved in one process).
    """

    gradients: GraphModule
    update: GraphModule
    update_inputs: list[int]  # indices of step inputs the update reads
    update_examples: list[Tensor]  # example tensors for the carried values
    slots: list[Tensor]  # example tensors for the slots (1-D, one per dtype and device)
    outputs: list[tuple[str, int]]  # for each step output: ("gradients" | "update", index)

    def runner(self, gradients: Callable, update: Callable) -> Callable[[list[Tensor]], list]:
        """Run the two compiled graphs as the step: ``run(inputs) -> outputs``."""
        n_carried = len(self.update_examples)
        slots = [torch.empty_like(s) for s in self.slots]

        def run(args: list[Tensor]) -> list[Tensor]:
            picked = [args[i] for i in self.update_inputs]
            first = gradients([*args, *slots])
            carried, computed = [*first[:n_carried], *slots, *picked], first[n_carried:]
            # The update's list holds the only reference to each gradient, so Inductor's
            # code frees each one right after its last use (a lower peak of memory; the time
            # is the same, measured on the bench MLP: about 30 us for its 18 gradients).
            del first
            parts = {"gradients": computed, "update": update(carried)}
            return [parts[where][i] for where, i in self.outputs]

        return run


def _data_dependent(node: Node) -> bool:
    values = node.meta.get("val")  # a value, a list, a profiler's ScriptObject, ...
    symbolic = (Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    values = values if isinstance(values, (list, tuple)) else [values]
    return any(isinstance(v, symbolic) and free_unbacked_symbols(v) for v in values)


def split_at_optimizer(gm: GraphModule) -> Split | None:
    """Cut ``gm`` at its optimizer marker; ``None`` if it has none or the update would need
    a symbolic size or make a data-dependent value (then the graph is compiled whole)."""
    if len(gm.graph.find_nodes(op="call_function", target=MARKER)) != 1:
        return None
    # Without dead values (an unused gradient of the first layer's input, say), so that
    # everything not needed for the gradients really is the update. Inductor drops them too.
    everything = list(gm.graph.nodes)
    live = live_nodes(everything)
    marker = gm.graph.find_nodes(op="call_function", target=MARKER)[0]
    nodes = [n for n in everything if n in live]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    results = list(nodes[-1].args[0])
    # The marker's outputs (getitems) stand for its inputs; the marker itself goes.
    marked = {user: marker.args[0][user.args[1]] for user in marker.users}

    downstream = _descendants(list(marked))
    # The gradients graph computes what the update takes and every output that does not
    # depend on the update; everything else (the update, the state writes) is the update.
    # In-place writes (and other impure ops) before the marker belong to forward and
    # backward even when nothing uses their result: later ops read the tensor written (a
    # channels-last model's backward writes gradients into an as_strided view). Dropped
    # from the gradients graph, they made its gradients wrong.
    writes = [n for n in nodes[: nodes.index(marker)] if n.op == "call_function" and has_effect(n)]
    roots = [
        *marker.args[0],
        *writes,
        *(r for r in results if isinstance(r, Node) and r not in downstream),
    ]
    in_gradients = _ancestors(roots)
    # A multi-output op's items go with it (the update takes a tensor, not the tuple):
    # GradScaler.update()'s new scale and growth tracker, which the update writes back.
    in_gradients |= {u for n in list(in_gradients) for u in n.users if u.target is operator.getitem}
    same = _hoist_scalars(nodes, in_gradients, marked)  # duplicates -> the one kept

    def resolve(value: Node) -> Node:
        value = marked.get(value, value)
        return same.get(value, value)

    update_nodes = [
        n
        for n in nodes
        if n.op == "call_function"
        and n not in in_gradients
        and n not in same
        and n is not marker
        and n not in marked
    ]
    if any(_data_dependent(n) for n in update_nodes):
        # A value read off a tensor after the update (``loss.item()`` of an evaluation that
        # follows opt.step()): the update alone, re-faked by Inductor, lacks its symbol.
        return None
    update_set = set(update_nodes)
    read = {resolve(a) for n in update_nodes for a in n.all_input_nodes}
    carried = [n for n in nodes if n.op == "call_function" and n in in_gradients and n in read]
    update_reads = [p for p in placeholders if p in read]
    if not all(_static(n) for n in (*carried, *update_reads)):
        return None
    scalars = [n for n in carried if _is_scalar(n)]
    carried = [n for n in carried if not _is_scalar(n)]
    # Where each scalar crosses: (slot, index); one slot per dtype and device.
    slot_of: dict[tuple, int] = {}
    place = {n: (slot_of.setdefault(_dtype_device(n), len(slot_of)), 0) for n in scalars}
    sizes = [0] * len(slot_of)
    for n in scalars:
        slot = place[n][0]
        place[n] = (slot, sizes[slot])
        sizes[slot] += 1
    slot_vals = [
        _packed_val(next(n for n in scalars if place[n][0] == k), size)
        for k, size in enumerate(sizes)
    ]

    # The update graph, rebuilt with canonical names: the same optimizer gives the same
    # code whatever the batch's shape, so Inductor's cache recognises it.
    update = Graph()
    env: dict[Node, Node] = {}
    for i, n in enumerate(carried):
        env[n] = update.placeholder(f"carried_{i}")
    packed = []
    for k in range(len(slot_vals)):
        # No value on the update's placeholders: like the others, it takes its inputs from
        # the examples compile.py gives (with cpp_wrapper, Inductor reads the placeholders'
        # values instead where any has one).
        packed.append(update.placeholder(f"scalars_{k}"))
    for p in update_reads:
        env[p] = update.placeholder(f"input_{placeholders.index(p)}")
    for n in scalars:
        slot, index = place[n]
        env[n] = _select(update, packed[slot], slot_vals[slot], index)
    for n in nodes:
        if n.op == "get_attr" and n in read:  # constants: the new module keeps them
            env[n] = update.get_attr(n.target)
    for n in update_nodes:
        args = torch.fx.map_arg(n.args, lambda a: env[resolve(a)])
        kwargs = torch.fx.map_arg(n.kwargs, lambda a: env[resolve(a)])
        env[n] = update.create_node(n.op, n.target, args, kwargs)
        env[n].meta = dict(n.meta)
    from_update = [isinstance(r, Node) and resolve(r) in update_set for r in results]
    update.output(tuple(env[resolve(r)] for r, u in zip(results, from_update, strict=True) if u))

    # The gradients graph: the original without the update, handing over what it needs.
    gradients = Graph()
    copies: dict[Node, Node] = {}
    gradients.graph_copy(gm.graph, copies)
    kept = [r for r, u in zip(results, from_update, strict=True) if not u]
    # Each scalar written into its place in a slot; the slots are inputs after the step's.
    last = copies[placeholders[-1]]
    slot_inputs = []
    for k, val in enumerate(slot_vals):
        with gradients.inserting_after(last):
            last = gradients.placeholder(f"slot_{k}")
        last.meta["val"] = val
        slot_inputs.append(last)
    for n in scalars:
        slot, index = place[n]
        view = _select(gradients, slot_inputs[slot], slot_vals[slot], index)
        gradients.call_function(torch.ops.aten.copy_.default, (view, copies[n]))
    gradients.output(
        tuple(copies[n] for n in carried)
        + tuple(copies[resolve(r)] if isinstance(r, Node) else r for r in kept)
    )
    for duplicate, kept_node in same.items():  # hoisted scalars may read a duplicate
        copies[duplicate].replace_all_uses_with(copies[kept_node])
    for n in reversed(everything):
        if n not in live or n in update_set or n in same or n in marked or n is marker:
            gradients.erase_node(copies[n])

    outputs, counts = [], {"gradients": 0, "update": 0}
    for u in from_update:
        where = "update" if u else "gradients"
        outputs.append((where, counts[where]))
        counts[where] += 1
    return Split(
        gradients=GraphModule(gm, gradients),
        update=GraphModule(gm, update),
        update_inputs=[placeholders.index(p) for p in update_reads],
        update_examples=[_example(n) for n in carried],
        slots=[_example(n) for n in slot_inputs],
        outputs=outputs,
    )


def _hoist_scalars(nodes: Sequence[Node], in_gradients: set[Node], marked: dict) -> dict:
    """Move the update's scalar arithmetic (bias corrections, step sizes: 0-dim values that
    need no gradient) into the gradients graph, in place in ``in_gradients``; returns the
    duplicates it found (the same op on the same inputs) mapped to the node kept.

    Inside one graph Inductor inlines such scalars into the pointwise kernels that use them,
    so a ``pow(beta2, step)`` in double runs once per vector of every parameter: measured
    here, the AdamW update of an 8 x 256 x 256 MLP took 1.8 ms, more than forward and
    backward. Computed before the update graph, each becomes one load. Writes (``copy_``,
    ``add_``), views and random ops stay where they are.
    """
    movable: set[Node] = set()
    for n in nodes:
        if n.op != "call_function" or n in in_gradients or not _pure_scalar(n):
            continue
        if any(a in marked for a in n.all_input_nodes):
            continue  # a 0-dim parameter's gradient: the update reads it through the marker
        if all(
            a.op in ("placeholder", "get_attr") or a in in_gradients or a in movable
            for a in n.all_input_nodes
        ):
            movable.add(n)
    # Only what a kernel over whole tensors reads: a scalar written straight into 0-dim
    # state (SGD's ``initialized`` flags) would only become one more output to allocate.
    wanted = _ancestors(
        [
            a
            for n in nodes
            if n.op == "call_function"
            and n not in movable
            and n not in in_gradients
            and not _is_scalar(n)
            for a in n.all_input_nodes
            if a in movable
        ]
    )
    seen: dict[tuple, Node] = {}
    same: dict[Node, Node] = {}
    for n in nodes:
        if n not in movable or n not in wanted:
            continue
        key = (
            n.target,
            repr(torch.fx.map_arg(n.args, lambda a: same.get(a, a))),
            repr(torch.fx.map_arg(n.kwargs, lambda a: same.get(a, a))),
        )
        if key in seen:
            same[n] = seen[key]
            continue
        seen[key] = n
        in_gradients.add(n)
    return same


def _dtype_device(node: Node) -> tuple:
    value = node.meta["val"]
    return value.dtype, value.device


def _packed_val(member: Node, size: int) -> Tensor:
    """The value of a 1-D slot of ``size`` scalars like ``member``'s, in the trace's fake
    mode where it has one."""
    value = member.meta["val"]
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty(size, dtype=value.dtype, device=value.device)


def _select(graph: Graph, slot: Node, value: Tensor, index: int) -> Node:
    """``slot[index]`` as a node of ``graph`` (appended), with its value (``slot``'s is
    ``value``)."""
    node = graph.call_function(torch.ops.aten.select.int, (slot, 0, index))
    node.meta["val"] = value.select(0, index)
    return node


def _is_scalar(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, Tensor) and value.dim() == 0


def _pure_scalar(node: Node) -> bool:
    """A 0-dim value computed by an op that writes nothing, aliases nothing, draws nothing,
    and that no later op writes into."""
    schema = getattr(node.target, "_schema", None)
    if not _is_scalar(node) or schema is None:
        return False
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return False
    for user in node.users:
        user_schema = getattr(user.target, "_schema", None)
        if user_schema is not None and user_schema.is_mutable:
            for arg, value in zip(user_schema.arguments, user.args, strict=False):
                if value is node and arg.alias_info is not None and arg.alias_info.is_write:
                    return False
    return True


def _descendants(start: Sequence[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def _ancestors(roots: Sequence[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _static(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, Tensor) and all(isinstance(s, int) for s in value.shape)


def _example(node: Node) -> Tensor:
    value = node.meta["val"]
    return torch.empty_strided(
        tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=value.device
    )
