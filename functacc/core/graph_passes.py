"""Passes over a jitted step's traced graph, before it is compiled.

- :func:`drop_unused_inputs`: inputs no op reads (a ``.grad`` the body discards) leave the
  graph, so graphs that differ only in them are the same program;
- :func:`drop_unread_ops`: an op whose result no op reads is not run, collectives
  included (ZeRO-2's gather of a gradient the body never reads whole);
- :func:`bernoulli_in_place`: dropout's draw back in the in-place form the CPU masks pass
  rewrites;
- :func:`direct_writes`: one copy per written input at the end, not two;
- :func:`written_inputs`: which inputs the graph writes into (CUDA graphs copy those that
  are not baked into the capture back out);
- :func:`fingerprint`: what makes two traced graphs the same program;
- :func:`sink_to_first_use`: ops computed from some inputs alone run where first read
  (ZeRO-3's gathers);
- :func:`has_effect`, :func:`live_nodes`: what runs for an effect, also where an op's
  schema hides its write (``native_batch_norm``'s running statistics), and what is kept;
- :func:`bools_as_tensors`: a Python bool the graph returns as its tensor (Inductor
  cannot compile a ``SymBool``: ``(out > 0).tolist()``);
- :func:`subtract_as_add`: ``sub(a, b, alpha=s)`` of a number the graph reads as
  ``add(a, b, alpha=-s)``, which functionalizing can trace.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.fx import GraphModule

from .signature import TensorSpec

__all__ = [
    "bernoulli_in_place",
    "bools_as_tensors",
    "direct_writes",
    "drop_unread_ops",
    "drop_unused_inputs",
    "fingerprint",
    "has_effect",
    "live_nodes",
    "sink_to_first_use",
    "subtract_as_add",
    "written_inputs",
]


def drop_unused_inputs(gm: GraphModule) -> list[int]:
    """Remove placeholders no op reads; return the indices of those kept."""
    used = []
    for i, node in enumerate(list(gm.graph.find_nodes(op="placeholder"))):
        if node.users:
            used.append(i)
        else:
            gm.graph.erase_node(node)
    gm.recompile()
    return used


def drop_unread_ops(gm: GraphModule) -> int:
    """Remove the ops whose results nothing reads: pure ATen ops and functional
    collectives (``wait_tensor`` counts as a side effect, so FX's dead-code elimination keeps
    every collective); return how many collectives went. Writes and random draws stay. Every
    rank traces the same body, so every rank drops the same collectives."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    dropped = 0
    for node in reversed(list(gm.graph.nodes)):  # readers before what they read
        if node.users or node.op != "call_function":
            continue
        if node.target is wait:
            if len(node.args[0].users) != 1:
                continue
        elif _is_collective(node):
            dropped += 1
        elif node.is_impure() or not _pure(node):  # asserts, writes, random draws
            continue
        gm.graph.erase_node(node)
    if dropped:
        gm.recompile()
    return dropped


def written_inputs(gm: GraphModule) -> list[int]:
    """The positions of the inputs that the graph writes into (functionalized writes are
    ``copy_`` into the input, at the end)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    targets = {
        n.args[0]
        for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    }
    return [i for i, p in enumerate(placeholders) if p in targets]


def _is_collective(node: torch.fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional"


def has_effect(node: torch.fx.Node) -> bool:
    """Whether ``node`` runs for an effect (a write, a draw, an assert), also where its
    schema hides the write (:func:`_hidden_writes`): kept even if nothing reads it."""
    return node.is_impure() or node.target in _hidden_writes()


def live_nodes(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes that ``Graph.eliminate_dead_code`` would keep, effects FX does not see
    included (:func:`has_effect`), without copying the graph to find out (that cost
    0.1-0.2 s of a large step's warm start)."""
    live: set[torch.fx.Node] = set()
    for n in reversed(nodes):
        if n.op in ("placeholder", "output") or has_effect(n) or any(u in live for u in n.users):
            live.add(n)
    return live


@functools.cache
def _hidden_writes() -> frozenset:
    """Ops that write into an input their schema does not mark as written:
    ``native_batch_norm`` updates the running statistics in place (a forward whose output
    is dropped still updates them in eager: PyTorch-GAN's relativistic_gan)."""
    aten = torch.ops.aten
    names = ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_impl_index")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _pure(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target in _hidden_writes():
        return False
    schema = target._schema
    # An op that returns nothing runs for its effect (aten._assert_async).
    return (
        bool(schema.returns)
        and not schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def bernoulli_in_place(gm: GraphModule) -> None:
    """Functionalization turns dropout's ``empty_like(x).bernoulli_(p)`` into the
    out-of-place ``bernoulli.p`` of the empty tensor (the same draws); put back the
    in-place form on the fresh tensor, which the CPU masks pass (masks.py) rewrites into
    1-byte masks drawn by functacc's kernel."""
    aten = torch.ops.aten
    for node in gm.graph.find_nodes(op="call_function", target=aten.bernoulli.p):
        source = node.args[0]
        fresh = source.op == "call_function" and source.target in (
            aten.empty_like.default,
            aten.empty.memory_format,
        )
        if fresh and len(source.users) == 1 and len(node.args) == 2 and not node.kwargs:
            node.target = aten.bernoulli_.float
    gm.recompile()


def direct_writes(gm: GraphModule) -> None:
    """Functionalization writes a mutated input as ``y = copy(x, value)`` then
    ``copy_(x, y)``: two copies of every written tensor. Write ``value`` directly, where
    ``value`` is computed in the graph: a view of an input (``ema_buffer.copy_(buffer)``)
    keeps its copy, since another final write may change that input before this one."""
    from ..backends.compile import _root

    aten = torch.ops.aten
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        target, source = node.args
        if (
            isinstance(source, torch.fx.Node)
            and source.target is aten.copy.default
            and source.args[0] is target
            and len(source.users) == 1
            and not source.kwargs
            and isinstance(source.args[1], torch.fx.Node)
            and _root(source.args[1]).op != "placeholder"
        ):
            node.args = (target, source.args[1])
            gm.graph.erase_node(source)
    gm.recompile()


_PLACEHOLDER = re.compile(r"\barg(\d+)_1\b")


def fingerprint(gm: GraphModule, inputs: list[str], specs: list, meta: tuple) -> tuple:
    """What makes two graphs the same program: their code over canonically named inputs,
    which named inputs those are, and what the call writes back."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    canonical = {name: f"in{i}" for i, name in enumerate(names)}
    code = _PLACEHOLDER.sub(lambda m: canonical.get(m.group(0), m.group(0)), gm.code)
    constants = tuple(
        (name, TensorSpec.of(value), value.cpu().numpy().tobytes())
        for name, value in sorted(gm.named_buffers())
        if isinstance(value, Tensor)
    ) + tuple(
        (name, TensorSpec.of(value), value.detach().cpu().numpy().tobytes())
        for name, value in sorted(vars(gm).items())
        if isinstance(value, Tensor)
    )
    return (code, tuple(inputs), tuple(specs), meta, constants)


def host_scalars(gm: GraphModule) -> bool:
    """Whether the graph reads a tensor's value into a Python number (``.item()``, a
    Python number fed to the step): such a graph's numbers live in its trace's fake mode.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> host_scalars(make_fx(lambda x: x * x.sum().item(), tracing_mode="fake")(torch.ones(2)))
        True
    """
    target = torch.ops.aten._local_scalar_dense.default
    return any(n.target is target for n in gm.graph.nodes)


def sink_to_first_use(gm: GraphModule, sources: Sequence[int]) -> None:
    """Move the ops computed from the inputs ``sources`` alone (placeholder positions) down
    to just before their first reader. ZeRO-3's gathers of parameter chunks, their waits
    and the views of the gathered parameters then run where the step starts using each
    unit, and its whole parameters live from there on, not from the start of the step.
    Every rank runs this pass on the same graph: the collectives keep one order."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    members = {placeholders[i] for i in sources}
    chain = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if (
            node.op == "call_function"
            and node.all_input_nodes
            and all(n in members for n in node.all_input_nodes)
            and not (schema is not None and schema.is_mutable)
        ):
            members.add(node)
            chain.append(node)
    moved = False
    for node in reversed(chain):  # readers first: each then moves below its own
        if not node.users:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(node.users, key=order.__getitem__)
        if order[first] > order[node] + 1:
            first.prepend(node)
            moved = True
    if moved:
        gm.recompile()


def bools_as_tensors(gm: GraphModule) -> int:
    """Return a bool tensor's value the graph returns (``.item()``, ``.tolist()`` of a bool
    tensor: ``scalar_tensor(_local_scalar_dense(t))``) as that 0-d tensor ``t``, the same
    value: the ``SymBool`` between the two is gone, which Inductor's passes cannot compare.
    Returns how many were rewritten.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> f = lambda x: [torch.scalar_tensor((x > 0).item(), dtype=torch.bool)]
        >>> gm = make_fx(f, tracing_mode="fake")(torch.ones(()))
        >>> bools_as_tensors(gm), "_local_scalar_dense" in gm.code, gm(torch.ones(()))
        (1, False, [tensor(True)])
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (list, tuple)):
        return 0
    rewritten = [_bool_tensor(value) for value in values]
    replaced = [old for new, old in zip(rewritten, values, strict=True) if new is not old]
    if replaced:
        output.args = (type(values)(rewritten),)
        for made in replaced:  # only these: an unused draw still draws (eager's generator)
            read = made.args[0]
            for node in (made, read):
                if not node.users:
                    gm.graph.erase_node(node)
        gm.recompile()
    return len(replaced)


def _bool_tensor(value: object) -> object:
    """The 0-d bool tensor whose value ``value`` makes a tensor of again, or ``value``."""
    aten = torch.ops.aten
    if not (isinstance(value, torch.fx.Node) and value.target is aten.scalar_tensor.default):
        return value
    read = value.args[0]
    if not (isinstance(read, torch.fx.Node) and read.target is aten._local_scalar_dense.default):
        return value
    source, made = read.args[0].meta.get("val"), value.meta.get("val")
    if not (isinstance(source, Tensor) and isinstance(made, Tensor)):
        return value
    same = (source.dtype, source.device, source.dim()) == (made.dtype, made.device, 0)
    return read.args[0] if same and source.dtype == torch.bool else value


def subtract_as_add(gm: GraphModule) -> int:
    """``sub(a, b, alpha=s)`` (``sub_``, ``_foreach_sub``) with ``s`` a number the graph
    reads (a learning rate fed to it: ``p.sub_(grad, alpha=group["lr"])``) as
    ``add(a, b, alpha=-s)``; returns how many. The reference ``sub`` that functionalizing
    traces asks ``alpha != 1``, which a number without a value cannot answer (nor can
    Inductor's functionalizing of the graph); ``add`` asks nothing. The same bits: ATen's
    ``sub`` is its ``add`` kernel with ``-alpha``, and ``a - s * b`` is ``a + (-s) * b``
    exactly (negation is exact).

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> f = lambda x, lr: x.sub_(x, alpha=lr.item())
        >>> gm = make_fx(f, tracing_mode="fake")(torch.ones(2), torch.tensor(0.5))
        >>> subtract_as_add(gm), "add_" in gm.code
        (1, True)
    """
    aten = torch.ops.aten
    as_add = {aten.sub.Tensor: aten.add.Tensor, aten.sub_.Tensor: aten.add_.Tensor}
    as_add |= {aten._foreach_sub.List: aten._foreach_add.List}
    as_add |= {aten._foreach_sub_.List: aten._foreach_add_.List}
    rewritten = 0
    for node in list(gm.graph.nodes):
        alpha = node.kwargs.get("alpha")
        if node.op != "call_function" or node.target not in as_add:
            continue
        if not isinstance(alpha, torch.fx.Node):
            continue
        with gm.graph.inserting_before(node):
            negated = gm.graph.call_function(operator.neg, (alpha,))
        if "val" in alpha.meta:
            negated.meta["val"] = -alpha.meta["val"]
        node.target = as_add[node.target]
        node.kwargs = {**node.kwargs, "alpha": negated}
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
