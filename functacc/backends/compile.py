"""Backends that turn a traced graph into a callable (the per-signature cache: ``cache.py``)."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import GraphModule, Node

from . import independent_loops, input_checks
from .bias_add import BiasAfterMatmul
from .errors import TraceError
from .independent_loops import independent_loops_nowait
from .inductor_call import direct_call
from .input_checks import input_checks_first

__all__ = [
    "Backend",
    "Compiled",
    "check_generators",
    "check_inductor_options",
    "compile_graph",
    "views_that_may_copy",
]

log = logging.getLogger("functacc")

Backend = Literal["inductor", "eager"]
BACKENDS = ("inductor", "eager")
Compiled = Callable[[list[Tensor]], Sequence[Tensor]]
"""A compiled graph, called with a list of input tensors (which it may clear), with grad
mode off: its in-place writes reach tensors that require grad (the step turns it off around
the call)."""


class CpuPasses(CustomGraphPass):
    """What functacc changes in Inductor's code for a CPU graph: the bias rule
    (:class:`~functacc.bias_add.BiasAfterMatmul`, a post-grad pass) and, while the graph
    compiles, the input checks in one call (:func:`~functacc.input_checks.input_checks_first`)
    and no barriers between independent loop nests
    (:func:`~functacc.independent_loops.independent_loops_nowait`); these two change code
    generation only, so their files are part of this pass's cache key."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        return BiasAfterMatmul()(graph)

    def uuid(self) -> bytes:
        # The two code-generation changes are keyed by their files' contents: a graph
        # compiled with and without them has the same key otherwise, and the cache would
        # hand back the other's code.
        codegen = (input_checks.__file__, independent_loops.__file__)
        return BiasAfterMatmul().uuid() + get_hash_for_files(codegen)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS}; got {backend!r}. Use 'inductor' for speed and "
            "'eager' to run the traced graph as is (debugging, fast tests)."
        )


def check_generators(gm: GraphModule, backend: str, model: nn.Module | None = None) -> None:
    """Refuse, under Inductor, a step that draws from a ``torch.Generator`` of its own.

    A draw such as ``torch.randn(shape, generator=self.g)`` keeps the generator object in
    the traced graph. The eager backend calls the op with that object, as eager does, so
    the draws and the generator's state after each step are eager's. Inductor writes the
    object into its generated code as a pickled copy: every step would draw from that
    copy, and the generator you hold would never advance (seen: its state unchanged after
    three steps, where eager's had moved three times). Draws from PyTorch's default
    generator (dropout, ``torch.randn`` without ``generator=``) are not affected.

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> g = torch.Generator().manual_seed(0)
        >>> gm = make_fx(lambda x: x + torch.randn(2, generator=g))(torch.ones(2))
        >>> check_generators(gm, "eager")  # the eager backend draws from g itself
        >>> check_generators(gm, "inductor")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        functacc.errors.TraceError: ...torch.Generator...
    """
    if backend != "inductor":
        return
    for node in gm.graph.nodes:
        generator = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if not isinstance(generator, torch.Generator):
            continue
        ops = sorted({str(user.target) for user in node.users})
        raise TraceError(
            f"the step draws random numbers from {_owner(generator, model)} "
            f"({', '.join(ops)}). Inductor compiles a generator into its code as a copy of "
            "its state at compile time, so every step would draw from that copy and your "
            "generator would never advance, unlike eager. Draw from PyTorch's default "
            "generator instead (leave out generator=, seed with torch.manual_seed), or "
            'build the step with backend="eager", which draws from your generator as eager '
            "does."
        )


def _owner(generator: torch.Generator, model: nn.Module | None) -> str:
    """Where the model keeps ``generator`` (``model.noise.g``), or what it is.

    The traced graph holds another Python object for the same generator, so the model's
    generators are matched by device and state (two seeded alike match both; the first is
    named)."""
    state = generator.get_state()
    for prefix, module in model.named_modules() if model is not None else ():
        for name, value in vars(module).items():
            if (
                isinstance(value, torch.Generator)
                and value.device == generator.device
                and torch.equal(value.get_state(), state)
            ):
                return f"the torch.Generator {'.'.join(['model', *filter(None, [prefix, name])])}"
    return f"a torch.Generator of your own (on {generator.device})"


def compile_graph(
    gm: GraphModule,
    example_inputs: Sequence[Tensor],
    backend: Backend,
    *,
    fakes: Sequence[Tensor] | None = None,
    options: dict[str, Any] | None = None,
) -> Compiled:
    """Compile ``gm`` with ``backend``; the result takes one list of tensors.

    ``"eager"`` runs the FX graph op by op with PyTorch's own kernels, which makes it
    bit-identical to eager PyTorch for the same op sequence. ``"inductor"`` generates fused
    C++/OpenMP (CPU) or Triton (CUDA) kernels; its FX graph cache makes a second process
    with the same graph skip code generation. ``fakes``: the symbolic fake inputs a
    dynamic-shape graph was traced with (Inductor then compiles size-generic kernels).
    ``options``: ``torch._inductor.config`` settings that override functacc's defaults.
    """
    from .masks import draw_masks_as_bytes
    from .parallel.schedule import issue_collectives_early
    from .remat import order_recomputation
    from .split import remove_marker, split_at_optimizer

    # Collectives are traced after the whole backward; start each gradient reduction as soon
    # as its gradients exist, so it overlaps the rest of backward (on every rank alike).
    issue_collectives_early(gm)
    if backend == "inductor":
        # Dropout's masks kept for backward in 1 byte per element instead of 4, drawn in
        # eager's order also where dropout's input is strided (masks.py). Not for the eager
        # backend: it lays buffers out by the trace's strides, where eager's empty_like
        # follows the real input's (the two differ where a meta kernel is wrong), and the
        # eager backend keeps the float mask alive anyway.
        draw_masks_as_bytes(gm)
        order_recomputation(gm)  # Inductor would pull recomputations into forward
    split = split_at_optimizer(gm) if backend == "inductor" else None
    remove_marker(gm)
    if backend == "eager":
        views_that_may_copy(gm)
        return lambda args: gm(*args)
    if split is not None:
        from .compile_worker import start_worker

        update_examples = [
            *split.update_examples,
            *split.slots,
            *(example_inputs[i] for i in split.update_inputs),
        ]
        # A worker process compiles the update into Inductor's cache meanwhile.
        worker = start_worker(split.update, update_examples, options or {})
        try:
            slots = split.slots
            if fakes is not None and slots:
                fake_mode = next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))
                fakes = [*fakes, *(fake_mode.from_tensor(s, static_shapes=True) for s in slots)]
            gradients = _inductor(split.gradients, [*example_inputs, *slots], fakes, options)
        except BaseException:
            if worker is not None:
                worker.stop()
            raise
        if worker is not None:
            worker.finish()
        update = _inductor(split.update, update_examples, None, options)
        return split.runner(gradients, update)
    return _inductor(gm, example_inputs, fakes, options)


def views_that_may_copy(gm: GraphModule) -> int:
    """Run the graph's ``view`` ops as ``reshape`` where nothing writes into the memory they
    view; returns how many were changed.

    The trace chose ``view`` where the fake tensors' strides allowed it, but some of
    PyTorch's meta kernels give other strides than the real kernel (``elu_backward`` of a
    transposed gradient: contiguous in the trace, transposed when run), and the eager
    backend then failed with "view size is not compatible with input tensor's size and
    stride" on a step eager PyTorch runs. ``reshape`` is that same view wherever the real
    strides allow one, and otherwise copies, as eager's autograd does. A view of memory
    that any op writes into (through any alias) is kept: there a copy could miss a write.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> views_that_may_copy(make_fx(lambda x: (x * 2).view(-1))(torch.ones(2, 3)))
        1
    """
    from .parallel.comm import writers

    changed = 0
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.view.default and not writers(_root(node)):
            node.target = torch.ops.aten.reshape.default
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _root(node: Node) -> Node:
    """The tensor whose memory ``node`` views (itself if it owns its memory)."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or first.alias_info.is_write:
            break
        node = node.args[0]
    return node


def check_inductor_options(options: dict[str, Any] | None, backend: str) -> dict[str, Any]:
    """Validate ``inductor_options`` up front (a typo must not surface minutes later, in
    the first compile)."""
    if not options:
        return {}
    if backend != "inductor":
        raise ValueError(
            f"inductor_options={options!r} was given with backend={backend!r}; they apply "
            "only to backend='inductor'"
        )
    from torch._inductor import config as inductor_config

    unknown = sorted(k for k in options if not hasattr(inductor_config, k.split(".")[0]))
    if unknown:
        raise ValueError(
            f"unknown inductor_options {unknown}: each key must be a torch._inductor.config "
            "setting, e.g. {'cpp_wrapper': True} or {'max_autotune': True}"
        )
    return dict(options)


def _inductor(
    gm: GraphModule,
    example_inputs: Sequence[Tensor],
    fakes: Sequence[Tensor] | None,
    user_options: dict[str, Any] | None = None,
) -> Compiled:
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    options = {}
    if all(t.device.type == "cpu" for t in example_inputs):
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
    # traced graph stays valid for inspection.
    graph = copy.deepcopy(gm)
    if fakes is None:
        # A fake mode with a ShapeEnv: without one Inductor's FX graph cache and
        # AOTAutograd's cache bypass the graph ("No shape env"), and every process
        # recompiles from scratch. Static shapes: the graph is specialised to its signature.
        # Detached examples: the graph already contains its backward, so Inductor must
        # compile it as an inference graph even when the inputs are parameters.
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fakes = [fake_mode.from_tensor(t.detach(), static_shapes=True) for t in example_inputs]
        sizes: list[tuple[int, int]] = []
    else:
        fake_mode = fakes[0].fake_mode
        sizes, fakes = _size_inputs(graph, fakes)
    _views_to_reshapes(graph)
    cpu = isinstance(options.get("post_grad_custom_post_pass"), CpuPasses)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(options))
        stack.enter_context(tracing(TracingContext(fake_mode)))
        if cpu:
            stack.enter_context(input_checks_first())
            stack.enter_context(independent_loops_nowait())
        compiled = compile_fx(graph, list(fakes))
    # compile_fx returns what Dynamo would call: a function of the unpacked inputs, inside
    # wrappers that have nothing to do for a static step graph; called directly where that
    # holds. Not for symbolic sizes: there the generated code takes more size inputs than
    # the graph (AOTAutograd's wrappers supply them).
    if sizes:
        return lambda args: compiled(*[args[i].shape[d] for i, d in sizes], *args)
    direct = direct_call(compiled, gm, example_inputs)
    return direct if direct is not None else lambda args: compiled(*args)


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
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        # Kept: a view written through, or a view of a tensor that something writes to.
        if not any(n in aliased_writes for n in chain(node)):
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
