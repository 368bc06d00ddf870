"""Compile one graph with Inductor, with functacc's settings and CPU passes.

:func:`compile_inductor` is what ``backend="inductor"`` runs for each graph of a step
(:func:`functacc.backends.compile.compile_graph` calls it for the gradients and the update
graph, and the update compile worker, ``compile_worker.py``, calls it in its own process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import GraphModule

from ..._compat import INDUCTOR_COMPILES_SIZE_GENERIC_INDEXING, warn_where_inductor_differs
from ...errors import TraceError
from ..graph_transport import copy_graph
from . import floats, independent_loops, input_checks
from .bias_add import BiasAfterMatmul
from .call import direct_call
from .floats import (
    float_symbols_in_double,
    floats_as_tensors,
    lerp_weights_as_tensors,
    no_tensorify,
)
from .independent_loops import independent_loops_nowait
from .input_checks import input_checks_first

__all__ = ["CpuPasses", "compile_inductor"]


class CpuPasses(CustomGraphPass):
    """What functacc changes in Inductor's code for a CPU graph: the bias rule
    (:class:`~.bias_add.BiasAfterMatmul`, a post-grad pass) and, while the graph compiles,
    the input checks in one call (:func:`~.input_checks.input_checks_first`) and no barriers
    between independent loop nests (:func:`~.independent_loops.independent_loops_nowait`);
    these two change code generation only, so their files are part of this pass's cache
    key."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        return BiasAfterMatmul()(graph)

    def uuid(self) -> bytes:
        # The two code-generation changes are keyed by their files' contents: a graph
        # compiled with and without them has the same key otherwise, and the cache would
        # hand back the other's code.
        codegen = (input_checks.__file__, independent_loops.__file__, floats.__file__)
        return BiasAfterMatmul().uuid() + get_hash_for_files(codegen)


def compile_inductor(
    gm: GraphModule,
    example_inputs: Sequence[Tensor],
    fakes: Sequence[Tensor] | None,
    user_options: dict[str, Any] | None = None,
    *,
    copy: bool = True,
) -> Callable[[list[Tensor]], Sequence[Tensor]]:
    """Compile ``gm`` with Inductor and functacc's settings (on CPU: :class:`CpuPasses` and
    the settings below; ``user_options`` override them); returns a
    :data:`~functacc.backends.compile.Compiled` (called with one list of tensors).

    ``fakes``: the symbolic fake inputs a dynamic-shape graph was traced with, or ``None``
    for a graph specialised to ``example_inputs``' shapes. ``copy=False`` lets the compile
    rewrite ``gm`` (no copy first)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    options = {}
    if all(t.device.type == "cpu" for t in example_inputs if isinstance(t, Tensor)):
        # Inductor's layout optimization converts convolutions to channels-last. In a whole
        # training step the weights are graph inputs rewritten every step, so it converts
        # them back and forth every call: measured here on ResNet-18 (2-core CPU, batch 32)
        # 138 ms/step with it, 58 ms without (eager: 77 ms).
        options["layout_optimization"] = False
        # Random ops (torch.randn, rand, randint, randperm inside forward) drawn by eager's
        # own kernels from PyTorch's generator, so they are eager's numbers and leave the
        # generator where eager leaves it. Inductor's own CPU generator drew other numbers
        # (a noisy model's losses differed from eager's from the first step). Dropout's
        # bernoulli_ has no Inductor CPU kernel and was eager's already.
        options["fallback_random"] = True
        warn_where_inductor_differs(gm)  # torch 2.11: the draws' order, 16-bit rounding
        # A linear layer's bias added in the kernel of what reads the layer's output, not
        # by ATen's addmm (which copies it into the output first): bias_add.py. The input
        # checks made in one call before the first kernel (input_checks.py), and independent
        # loop nests without barriers between them (independent_loops.py). A
        # post_grad_custom_post_pass of the caller's replaces all three.
        options["post_grad_custom_post_pass"] = CpuPasses()
        # A kernel runs on one thread unless each thread gets 8192 elements or more
        # (Inductor's default: 512). Below that, OpenMP's fork and join cost more than
        # the second core gives: the bench MLP's 32 x 256 activations and their
        # gradients. Measured per step with benchmarks/experiments/step_breakdown.py, interleaved
        # (2-core CPU): MLP 0.92 vs 0.98 ms, GPT-2 41.3-42.0 vs 42.6-43.5 ms; the
        # Transformer, ResNet-18 and ResNet-50 within noise.
        options["cpp.min_chunk_size"] = 8192
    # bf16/fp16 compute rounded as eager rounds it (every op's result to its dtype), not
    # kept in float32 across a fused kernel: a bf16 model's step then equals eager's bit
    # for bit (tested on CPU); measured on the bench Transformer with precision="bf16":
    # 90.6 vs 91.0 samples/s. A no-op for float32.
    options["emulate_precision_casts"] = True
    options.update(user_options or {})
    # compile_fx may rewrite the graph it is given (pytorch#138980): compile a copy, so the
    # traced graph stays valid for inspection. ``copy=False``: a graph made for this compile
    # alone (the split's), compiled as it is.
    graph = gm
    if copy:
        graph = GraphModule(gm, copy_graph(gm.graph))
        graph.meta.update(gm.meta)
    if fakes is None:
        # A fake mode with a ShapeEnv: without one Inductor's FX graph cache and
        # AOTAutograd's cache bypass the graph ("No shape env"), and every process
        # recompiles from scratch. Static shapes: the graph is specialised to its signature.
        # Detached examples: the graph already contains its backward, so Inductor must
        # compile it as an inference graph even when the inputs are parameters.
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fakes = [fake_mode.from_tensor(t.detach(), static_shapes=True) for t in example_inputs]
        sizes: list[tuple[int, int]] = []
        floats: list[int] = []
    else:
        fake_mode = next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))
        fakes, floats = floats_as_tensors(graph, fakes)
        sizes, fakes = _size_inputs(graph, fakes)
    _views_to_reshapes(graph)
    lerp_weights_as_tensors(graph)
    cpu = isinstance(options.get("post_grad_custom_post_pass"), CpuPasses)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(options))
        stack.enter_context(tracing(TracingContext(fake_mode)))
        if cpu:
            stack.enter_context(input_checks_first())
            stack.enter_context(independent_loops_nowait())
        # Always, not only with float inputs: a float symbol can reach the graph another
        # way (seen with Rprop and timm's ADOPT on a cold cache), and the pass's answer, a
        # restart, is for Dynamo, which a make_fx graph has not.
        stack.enter_context(no_tensorify())
        stack.enter_context(float_symbols_in_double())
        try:
            compiled = compile_fx(graph, list(fakes))
        except Exception as exc:
            if (
                sizes
                and not INDUCTOR_COMPILES_SIZE_GENERIC_INDEXING
                and "CppCompileError" in repr(exc)
            ):
                raise TraceError(
                    f"torch {torch.__version__}'s Inductor failed to compile this step's "
                    "size-generic C++ kernels (torch 2.11 emits an index bounds check on a "
                    "variable it declared elsewhere; torch 2.14 and 2.15 compile such steps). "
                    "Build the step with dynamic=False (one graph per shape), or use a newer "
                    "torch."
                ) from exc
            raise
    # compile_fx returns what Dynamo would call: a function of the unpacked inputs, inside
    # wrappers that have nothing to do for a static step graph; called directly where that
    # holds. Not for symbolic sizes: there the generated code takes more size inputs than
    # the graph (AOTAutograd's wrappers supply them).
    if floats:  # Python floats go in as 0-dim float64 tensors (floats.py), after the sizes
        run = _floats_wrapped(compiled, [p + len(sizes) for p in floats])
        if sizes:
            return lambda args: run([*[args[i].shape[d] for i, d in sizes], *args])
        return run
    if sizes:
        return lambda args: compiled(*[args[i].shape[d] for i, d in sizes], *args)
    direct = direct_call(compiled, gm, example_inputs)
    return direct if direct is not None else lambda args: compiled(*args)


def _floats_wrapped(compiled: Callable[..., Any], positions: list[int]) -> Callable[[list], Any]:
    def run(args: list) -> Any:
        for i in positions:
            args[i] = torch.tensor(args[i], dtype=torch.float64)
        return compiled(*args)

    return run


def _size_inputs(
    gm: GraphModule, fakes: Sequence[Tensor]
) -> tuple[list[tuple[int, int]], list[Any]]:
    """Make each symbolic size an input of its own, as in Dynamo's graphs; returns where
    to read each at run time ``(input, dim)`` and the example inputs with them first.

    Inductor's pass that turns Python float arithmetic on sizes into tensor math (a
    ``mean`` or ``MSELoss`` over a symbolic batch divides by ``8 * s0``) rebuilds each
    expression from graph nodes that hold its symbols; a ``make_fx`` graph has such a node
    only where its own code read a size, and the compile failed with ``KeyError: s0``.
    """
    sizes: list[tuple[int, int]] = []
    symbols: list[torch.SymInt] = []
    seen: set = set()
    for i, fake in enumerate(fakes):
        if not isinstance(fake, Tensor):  # a Python number input: a symbol already
            continue
        for d, size in enumerate(fake.shape):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol and expr not in seen:
                seen.add(expr)
                sizes.append((i, d))
                symbols.append(size)
    if not symbols:
        return [], list(fakes)
    first = next(iter(gm.graph.find_nodes(op="placeholder")))
    with gm.graph.inserting_before(first):
        for k, size in enumerate(symbols):
            gm.graph.placeholder(f"size_{k}").meta["val"] = size
    gm.recompile()
    return sizes, [*symbols, *fakes]


def _views_to_reshapes(gm: GraphModule) -> None:
    """Turn ``aten.view`` into ``aten.reshape`` where nothing writes through the view.

    Inductor re-traces the graph with its own decompositions, whose outputs may have other
    strides than the kernels the trace saw (e.g. ``cat`` with an empty tensor, as a
    key/value cache starts), so a view the trace recorded can become impossible and the
    compile fails (measured: HF GPT-2 with 64-wide heads, static and symbolic sizes).
    ``reshape`` is the same value (a copy only where a view is impossible); a view that an
    in-place op writes through must stay a view, so those are kept (Inductor's own post-grad
    pass does this rewrite once the graph is functional).
    """

    def chain(node: object) -> Iterator[torch.fx.Node]:
        """``node`` and the tensors it is a view of."""
        while isinstance(node, torch.fx.Node):
            yield node
            is_view = getattr(node.target, "is_view", False)
            node = node.args[0] if is_view and node.args else None

    aliased_writes: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                aliased_writes.update(chain(value))
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        # Kept: a view written through, or a view of a tensor that something writes to.
        if not any(n in aliased_writes for n in chain(node)):
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:  # regenerating the code costs 0.1-0.3 s on a large step: not for nothing
        gm.recompile()
