"""Activation rematerialisation: recompute chosen modules' activations in backward.

Inside the traced step, each module whose class is chosen runs under non-reentrant
``torch.utils.checkpoint``: its activations are not kept for backward; backward runs its
forward again. Random ops (dropout) must draw the same numbers the second time; a dispatch
mode records their results in forward and replays them in the recomputation, so the
gradients are exactly those of the stored-activation step.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx import GraphModule, Node
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call uses
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ..core.functional import check_module_classes

__all__ = [
    "POLICIES",
    "RematPolicy",
    "order_recomputation",
    "rematerialize",
    "save_matmuls",
    "validate_remat",
]


class _RandomReplay(TorchDispatchMode):
    """Records the results of random ops on the first run, replays them on the second.

    Bernoulli draws (dropout masks) are 0 or 1: they are kept as ``uint8``, a quarter of
    the float mask's memory, and turned back into the same values exactly.
    """

    def __init__(self, recorded: list, *, replaying: bool) -> None:
        super().__init__()
        self.replaying = replaying
        self.recorded = recorded
        self.position = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        if not self.replaying:
            out = func(*args, **kwargs)
            # A copy: dropout divides its mask in place right after drawing it. Some ops
            # that may draw return several tensors (fused attention with dropout_p).
            zero_one = func._overloadpacket in _BERNOULLI
            self.recorded.append(pytree.tree_map_only(torch.Tensor, _keep(zero_one), out))
            return out
        value = self.recorded[self.position]
        self.position += 1
        if func._schema.is_mutable:  # bernoulli_(self): write the recorded draw into self
            return args[0].copy_(value.stored)
        return pytree.tree_map_only(_Draw, lambda d: d.stored.to(d.dtype, copy=True), value)


_BERNOULLI = (torch.ops.aten.bernoulli, torch.ops.aten.bernoulli_)


@dataclass(frozen=True)
class _Draw:
    """One recorded random tensor and the dtype it had (a leaf for pytree, unlike a
    NamedTuple, which would be flattened into its fields)."""

    stored: torch.Tensor
    dtype: torch.dtype


def _keep(zero_one: bool) -> Callable[[torch.Tensor], _Draw]:
    """How to record a random result. Bernoulli draws are 0 or 1, so a byte holds them
    exactly in a quarter of a float mask's memory (``uint8``, not ``bool``: Inductor's CPU
    kernels store and load bool vectors element by element; see
    ``backends/inductor/masks.py``)."""

    def keep(t: torch.Tensor) -> _Draw:
        return _Draw(t.to(torch.uint8) if zero_one else t.clone(), t.dtype)

    return keep


# Node metadata: which module call's forward pass, or recomputation, an FX node belongs to.
FORWARD = "functacc_remat_forward"
RECOMPUTE = "functacc_recompute"
_calls = itertools.count()

RematPolicy = Literal["full", "save_matmuls", "selective"]
POLICIES = ("full", "save_matmuls", "selective")
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


def _traced_graph() -> torch.fx.Graph | None:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def _with_replay(module: nn.Module, forward: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        recorded: list = []
        calls = {"n": 0}
        # The tensors the forward pass reads: inside the traced step these are the step's
        # parameters, swapped in by functional_call. Backward runs after that swap has
        # ended, so the recomputation swaps the same tensors in again; otherwise it would
        # read the module's own nn.Parameters, which the trace bakes in as constants
        # (Inductor compiled their values at the first step: stale gradients afterwards).
        tensors = {
            **dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False)),
        }

        call = next(_calls)  # names this call's forward and recomputation in the graph

        def body(*a: Any, **k: Any) -> Any:
            # The first call is the forward pass; the second, from backward, recomputes.
            replaying = calls["n"] > 0
            calls["n"] += 1
            swap = _reparametrize_module(module, tensors) if replaying else contextlib.nullcontext()
            graph = _traced_graph()
            last = next(iter(reversed(graph.nodes)), None) if graph is not None else None
            try:
                with swap, _RandomReplay(recorded, replaying=replaying):
                    return forward(*a, **k)
            finally:
                # Also when checkpoint stops the recomputation early (by raising) once it
                # has every value backward needs.
                if graph is not None:
                    key = RECOMPUTE if replaying else FORWARD
                    for node in reversed(graph.nodes):
                        if node is last:
                            break
                        node.meta[key] = call

        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def validate_remat(model: nn.Module, classes: Collection[str] | None) -> frozenset[str]:
    if not classes:
        return frozenset()
    return frozenset(check_module_classes(model, classes, "remat"))


@contextlib.contextmanager
def rematerialize(model: nn.Module, classes: Collection[str]) -> Iterator[None]:
    """Run the outermost modules of the given classes under checkpointing (while active)."""
    if not classes:
        yield
        return
    patched: list[nn.Module] = []
    prefixes: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ not in classes:
            continue
        if any(name.startswith(p + ".") for p in prefixes):
            continue  # inside a module already recomputed as a whole
        prefixes.append(name)
        module.forward = _with_replay(module, module.forward)  # an instance attribute shadows
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


class _NoCheckpointDraws(TorchDispatchMode):
    """Refuses a random draw made by ``torch.utils.checkpoint``'s recomputation while the
    step takes its gradients. Eager restores the forward's RNG state before recomputing, so
    the recomputed dropout masks equal the forward's; a traced graph cannot restore it (the
    restore happens in Python at trace time), so its recomputation would draw new masks and
    silently give other gradients. functacc's own ``remat`` replays the forward's draws."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if torch.Tag.nondeterministic_seeded in func.tags and _in_torch_checkpoint():
            from ..errors import argument_error

            raise argument_error(
                f"torch.utils.checkpoint recomputes a region that draws random numbers "
                f"({func._overloadpacket.__name__}, e.g. dropout) during backward. Eager "
                "PyTorch replays the forward's random state there; a compiled step cannot, "
                "and would use other dropout masks. Let functacc recompute instead: remove "
                "the checkpoint call (or turn off the model's gradient checkpointing) and "
                "pass compile_step(..., remat={'BlockClassName'}), which keeps the masks."
            )
        return func(*args, **(kwargs or {}))


def _in_torch_checkpoint() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


@contextlib.contextmanager
def no_checkpoint_draws() -> Iterator[None]:
    """Around the trace's ``torch.autograd.grad``: see :class:`_NoCheckpointDraws`."""
    with _NoCheckpointDraws():
        yield
