"""The one tracer: a flat function of tensors into one FX graph of ATen ops, on fake tensors.

Both front doors trace with it: ``jit`` (and ``compile_step``, a standard body on it) gives
it an eager step body, whose in-place writes (``backward()`` accumulating ``.grad``,
``opt.step()``, an EMA update) land anywhere: ``functional=True`` traces that body with
autograd running, then traces ``torch.func.functionalize`` of the result, which moves every
write into an input to the very end of the graph, after all computation that could fail.

Tracing runs on fake tensors: no real computation happens, so BatchNorm statistics, the
RNG and every real tensor are untouched by a trace, and Python branches on tensor values
fail loudly instead of being silently baked into the graph.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import TraceError
from .diagnostics import translate
from .eager_inplace import mark_inplace, restore_inplace, traced_node_by_node
from .failure_sites import COPIED, hashed_size, is_data_dependent
from .graph_passes import bernoulli_in_place, direct_writes, subtract_as_add
from .host_values import ValuesOnHost
from .packed import HostPacking
from .watches import AttributeWatch, ClockWatch, GradWatch, HeldRandomWatch, HostRandomWatch

__all__ = ["Traced", "symbolic_fakes", "trace"]


class Traced:
    """A traced step graph and, when some input dimensions were symbolic, what it needs:
    ``fakes``, the fake inputs it was traced with (sizes symbols where dynamic), for
    Inductor's dynamic-shape compile; ``guard``, the condition over them under which the
    graph is valid (``None``: none)."""

    def __init__(
        self,
        graph: GraphModule,
        fakes: list[Tensor] | None,
        guard: str | None,
        fake_mode: Any = None,
    ):
        self.graph = graph
        self.fakes = fakes
        self.guard = guard
        self.fake_mode = fake_mode  # where a graph with unbacked symbols or numbers compiles
        self.example_fakes: list[Any] = []
        # The condition over the Python-number inputs under which the graph holds, and
        # where in the user's code it branched ("utils.py:53 in progress_bar").
        self.number_guard: str | None = None
        self.branch_sites: list[str] = []
        self.read_values = False  # it read known batch values as numbers (host_values.py)


def trace(
    fn: Callable[..., object],
    example_inputs: Sequence[Tensor],
    *,
    holder: nn.Module,
    signature: str,
    dynamic: Sequence[Collection[int]] | None = None,
    functional: bool = False,
    strict: bool = False,
    watches: Sequence[contextlib.AbstractContextManager] = (),
    on_error: Callable[[Exception], Exception] | None = None,
    read_values: bool = False,
) -> Traced:
    """Trace ``fn(*example_inputs)`` into a graph module with fake tensors.

    Args:
        holder: the module(s) the step runs; their Python attributes and the generators
            they hold must not change while tracing (eager would change them every step).
        signature: a description of the inputs, for error messages.
        dynamic: one collection of dimension indices per input, traced symbolically (0 and
            1 specialised; static where the step hashes one): see :class:`Traced`.
        functional: ``fn`` writes into its inputs anywhere (an eager step body): trace it,
            then functionalize it so that every write is a ``copy_`` at the end.
        strict: a real tensor ``fn`` reads that is none of the inputs is an error, not a constant.
        watches: more context managers around the trace (the caller's own checks).
        on_error: the exception to raise for one met while tracing (by default a
            :class:`TraceError` naming the module and source line).
        read_values: read known batch values as numbers from the start (host_values.py),
            as an earlier trace of this step needed (``traced.read_values``).

    Example:
        >>> import torch
        >>> from functacc.core.tracer import trace
        >>> traced = trace(lambda x: (x.sin() * 2,), [torch.randn(3)],
        ...                holder=torch.nn.Module(), signature="x")
        >>> [n.target.__name__ for n in traced.graph.graph.nodes if n.op == "call_function"]
        ['sin.default', 'mul.Tensor']
    """
    devices = sorted({t.device.index or 0 for t in example_inputs if _tensor(t) and t.is_cuda})
    # Python numbers among the inputs (a counter, a scale the body reads) are traced as
    # symbols with their value as hint: a branch on one is a guard (Traced.number_guard).
    detached = [t.detach() if _tensor(t) else t for t in example_inputs]
    dims = dynamic if dynamic is not None and any(dynamic) else None
    try:
        with contextlib.ExitStack() as stack:
            for watch in (
                *(AttributeWatch(holder), GradWatch(holder), HeldRandomWatch(holder)),
                *(HostRandomWatch(), ClockWatch()),
                HostPacking(),  # a packed sequence's batch sizes on the host (packed.py)
                _quiet_fake_tensor_log(),
                *watches,
            ):
                stack.enter_context(watch)
            try:
                with (values := ValuesOnHost(read=read_values)):
                    traced = _trace(fn, detached, devices, dims, functional, strict)
            except Exception as exc:
                # Sizes this trace cannot keep symbolic (a guard over a size and a number, a
                # size hashed): traced static, said in the retrace's reason.
                fixed = str(exc) if isinstance(exc, _MixedGuard) else hashed_size(exc, dims)
                if fixed is not None:
                    traced = _trace(fn, detached, devices, None, functional, strict)
                    traced.fixed = fixed
                # A size made of a batch's values (lengths.tolist()): read them (host_values)
                elif values.read or not (values.known_reads and is_data_dependent(exc)):
                    raise
                else:
                    with (values := ValuesOnHost()):
                        traced = _trace(fn, detached, devices, dims, functional, strict)
            traced.read_values = values.read
    except Exception as exc:
        if getattr(exc, "_functacc_user_error", False) or isinstance(exc, TraceError):
            raise
        raise (on_error or (lambda e: translate(e, holder, signature)))(exc) from exc
    if functional:
        bernoulli_in_place(traced.graph)
        direct_writes(traced.graph)
    return traced


def _trace(
    fn: Callable[..., object],
    detached: list[Tensor],
    devices: list[int],
    dynamic: Sequence[Collection[int]] | None,
    functional: bool,
    strict: bool,
) -> Traced:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # fork_rng: the first make_fx of a process draws from the global generator while it
    # initialises; a trace must leave the RNG exactly where it was. no_grad: a pure step
    # turns autograd on where it differentiates; an eager body sets the caller's mode.
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        if dynamic is None:
            mode = _FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=not strict)
            fakes = [
                mode.from_tensor(t, static_shapes=True) if _tensor(t) else _number(mode, t, i)
                for i, t in enumerate(detached)
            ]
            graph = _make_fx(fn, fakes, "fake", functional, strict)
            traced = Traced(graph, None, None, mode)
            traced.example_fakes = fakes
            traced.number_guard = _number_guard(mode.shape_env, fakes)
            traced.branch_sites = _branch_sites(mode.shape_env) if traced.number_guard else []
            return traced
        fakes = symbolic_fakes(detached, dynamic, strict=strict)
        with _eager_kernels():
            graph = _make_fx(fn, fakes, "symbolic", functional, strict)
    shape_env = fakes[0].fake_mode.shape_env
    dynamic_fakes = [f for f, dims in zip(fakes, dynamic, strict=True) if dims]
    # Guards over the inputs with symbolic dimensions only (named t0, t1, ... in that
    # order); the static dimensions are checked exactly by the caller.
    try:
        guard = shape_env.produce_guards_expression(dynamic_fakes)
        number_guard = _number_guard(shape_env, fakes)
    except AssertionError as exc:  # a guard over a size and a Python number together
        if "sources must not be empty" in str(exc):
            raise _MixedGuard from exc
        raise
    traced = Traced(graph, fakes, guard, fakes[0].fake_mode)
    traced.example_fakes = fakes
    traced.number_guard = number_guard
    traced.branch_sites = _branch_sites(shape_env) if number_guard else []
    return traced


class _MixedGuard(Exception):
    """The trace branched on a Python number computed from a symbolic size (timm's
    ``AverageMeter``: ``self.count += input.size(0)``, then ``if self.count``): its guard
    names both, which neither the size guard nor the number guard can hold."""


def _tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def _number(mode: Any, value: float, index: int) -> Any:
    """A symbol of ``mode``'s shape environment standing for the Python number ``value``
    (its hint): the graph takes the number as an input."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env, source = mode.shape_env, LocalSource(f"number{index}")
    symbol = env.create_unspecified_symbol(value, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    if isinstance(value, float):
        return env.create_symfloatnode(symbol, hint=value, source=source)
    return env.create_symintnode(symbol, hint=value, source=source)


def _number_guard(shape_env: Any, fakes: Sequence[Any]) -> str | None:
    """The condition, over the Python-number inputs (named ``t0, t1, ...`` in order), under
    which the graph holds (its branches on them)."""
    numbers = [f for f in fakes if isinstance(f, (torch.SymInt, torch.SymFloat))]
    if not numbers:
        return None
    return shape_env.produce_guards_expression(numbers) or None


def _branch_sites(shape_env: Any) -> list[str]:
    """Where the user's code made the trace's guards, in order, each once."""
    from .python_output import is_user_code

    sites: dict[str, None] = {}
    for guard in shape_env.guards:
        frame = getattr(guard.sloc, "framework_loc", None)
        filename = getattr(frame, "filename", None)
        if filename is not None and is_user_code(filename):
            name = os.path.basename(filename)
            sites[f"{name}:{frame.lineno} in {frame.name}"] = None
    return list(sites)


def _make_fx(
    fn: Callable[..., object], fakes: list[Tensor], mode: str, functional: bool, strict: bool
) -> GraphModule:
    # `_allow_non_fake_inputs` (not strict): tensors a module keeps outside what the step
    # lifts as inputs are real; they become constants of the graph. Fresh handles per pass:
    # an eager body marks its parameters as requiring grad and sets their .grad, which the
    # second pass must not see. Lazy graph modules: the passes after a trace edit the graph
    # several times; its Python code (half a second for a large step) is made once, when run.
    def run(f: Callable[..., object]) -> GraphModule:
        with _use_lazy_graph_module(True):
            args = [t.detach() if _tensor(t) else t for t in fakes]
            return make_fx(f, tracing_mode=mode, _allow_non_fake_inputs=not strict)(*args)

    first = run(fn)
    if not functional:
        return first
    # Eager's in-place ops on intermediates (a GRU cell's) come back after functionalizing
    # (eager_inplace.py): their tags ride through a trace run node by node.
    subtract_as_add(first)
    mark_inplace(first)
    _carry_meta(first)
    with fx_traceback.preserve_node_meta():
        second = run(torch.func.functionalize(traced_node_by_node(first), remove="mutations"))
    restore_inplace(second)
    _uncarry_meta(second)
    return second


# functacc's own node metadata (remat's forward and recomputation regions: FORWARD and
# RECOMPUTE in transforms/remat.py) rides through the functionalizing trace in the one field
# that trace copies from node to node, "custom", and is put back where the passes read it.
_OWN_META = "functacc_"


def _carry_meta(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        own = {k: v for k, v in node.meta.items() if k.startswith(_OWN_META)}
        if own:
            node.meta["custom"] = {**node.meta.get("custom", {}), **own}


def _uncarry_meta(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if not custom or not any(k.startswith(_OWN_META) for k in custom):
            continue
        for k, v in custom.items():
            if k.startswith(_OWN_META):
                node.meta[k] = v
        rest = {k: v for k, v in custom.items() if not k.startswith(_OWN_META)}
        if rest:
            node.meta["custom"] = rest
        else:
            del node.meta["custom"]


# Ops whose kernel returns one tensor in two output slots: oneDNN's LSTM backward gives the
# two biases (b_ih, b_hh) one gradient. The fake-tensor cache rebuilds each output of a hit
# on its own, so a trace served from the cache (a later trace of the same shapes, in any
# step of the process) would see two tensors where the first saw one: autograd's
# AccumulateGrad then keeps both where eager copies one (eager's two .grad are distinct),
# and the two traces make two graphs, hence a second trace and compile of the same step.
# These ops are never cached.
_REPEATED_OUTPUTS = frozenset({torch.ops.aten.mkldnn_rnn_layer_backward.default})


class _FakeTensorMode(FakeTensorMode):
    """A ``FakeTensorMode`` that runs the meta kernel of every op in ``_REPEATED_OUTPUTS``
    afresh instead of serving it from the fake-tensor cache, so that every trace sees one
    tensor where eager's kernel returns one."""

    def __deepcopy__(self, memo: dict) -> _FakeTensorMode:  # a traced tensor copied
        raise TraceError(COPIED)

    def _validate_cache_key(self, func: Any, args: Any, kwargs: Any) -> None:
        if func in _REPEATED_OUTPUTS:
            raise _BypassDispatchCache("an output slot repeats another")
        super()._validate_cache_key(func, args, kwargs)


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """A shape error in the model is reported once, as a TraceError naming the module and
    the inputs; without this, the fake-tensor layer also logs its whole traceback at ERROR
    level ("failed while attempting to run meta for aten.mm.default")."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def symbolic_fakes(
    inputs: Sequence[Tensor], dynamic: Sequence[Collection[int]], *, strict: bool = False
) -> list[Tensor]:
    """Fake copies of ``inputs`` whose dimensions listed in ``dynamic`` are symbols."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    # No duck sizing: a batch of 8 sequences of length 8 must not tie the two dimensions
    # together; equal sizes that the model relates are discovered as guards instead.
    mode = _FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=not strict)
    fakes = []
    source_index = 0
    for i, (t, dims) in enumerate(zip(inputs, dynamic, strict=True)):
        if not _tensor(t):
            fakes.append(_number(mode, t, i))
            continue
        if not dims:
            fakes.append(mode.from_tensor(t, static_shapes=True))
            continue
        sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())]
        context = StatelessSymbolicContext(dynamic_sizes=sizes)
        source = LocalSource(f"t{source_index}")  # the name the guard expression uses
        source_index += 1
        fakes.append(mode.from_tensor(t, source=source, symbolic_context=context))
    return fakes


def _eager_composites() -> list[Any]:
    """The ops :func:`_eager_kernels` keeps on their C++ composite: dropout, and the
    recurrent layers' (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``; padded and packed input)."""
    aten = torch.ops.aten
    rnns = (aten.lstm, aten.gru, aten.rnn_tanh, aten.rnn_relu)
    return [aten.dropout.default, *(rnn.input for rnn in rnns), *(rnn.data for rnn in rnns)]


@contextlib.contextmanager
def _eager_kernels() -> Iterator[None]:
    """Trace ``aten.dropout`` and the recurrent layers as eager PyTorch runs them.

    Symbolic tracing turns on the Python dispatcher, under which these ops take torch's
    Python decompositions. On CPU eager PyTorch runs the C++ composites instead. For
    ``aten.dropout`` (``native_dropout`` against eager's ``bernoulli_`` on an empty tensor)
    that draws a different random stream: the same seed would give different masks. For
    ``aten.lstm`` the decomposition calls oneDNN's layer in inference mode or unrolls the
    cell in other ops than eager's, and draws the dropout between layers otherwise. Hiding
    the Python kernels while tracing keeps the C++ composites: eager's numbers and masks.
    """
    from torch._C import DispatchKey

    keys = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
    saved = [
        (op, {k: op.py_kernels.pop(k) for k in keys if k in op.py_kernels})
        for op in _eager_composites()
    ]
    for op, _ in saved:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernels in saved:
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()
