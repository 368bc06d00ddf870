"""Backends that turn a traced graph into a callable (the per-signature cache: ``cache.py``).

``"eager"`` runs the graph as traced; ``"inductor"`` compiles it with
:func:`~.inductor.compile.compile_inductor`, the optimizer update apart (``split.py``), in
a worker process where that helps (``compile_worker.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from ..errors import TraceError
from . import compile_worker
from .background import BackgroundCompiled
from .background import busy as background_busy
from .inductor import compile_inductor

__all__ = [
    "Backend",
    "Compiled",
    "check_backend",
    "check_background",
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


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS}; got {backend!r}. Use 'inductor' for speed and "
            "'eager' to run the traced graph as is (debugging, fast tests)."
        )


def check_background(background: Any, backend: str) -> None:
    """Validate ``background_compile`` up front: a bool, and only for Inductor (the eager
    backend has nothing to compile)."""
    if not isinstance(background, bool):
        raise TypeError(f"background_compile must be True or False; got {background!r}")
    if background and backend != "inductor":
        raise ValueError(
            f"background_compile=True was given with backend={backend!r}; it compiles with "
            "Inductor while the first steps run the traced graph, so it needs "
            "backend='inductor' (the eager backend runs the traced graph always)"
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
    background: bool = False,
) -> Compiled:
    """Compile ``gm`` with ``backend``; the result takes one list of tensors.

    ``"eager"`` runs the FX graph op by op with PyTorch's own kernels, which makes it
    bit-identical to eager PyTorch for the same op sequence. ``"inductor"`` generates fused
    C++/OpenMP (CPU) or Triton (CUDA) kernels; its FX graph cache makes a second process
    with the same graph skip code generation. ``fakes``: the symbolic fake inputs a
    dynamic-shape graph was traced with (Inductor then compiles size-generic kernels).
    ``options``: ``torch._inductor.config`` settings that override functacc's defaults.
    ``background``: Inductor compiles in a worker process while the graph runs as traced
    (:mod:`functacc.backends.background`), for static graphs on CPU without collectives
    where a worker can start; elsewhere it compiles here.
    """
    from ..core.graph_passes import bools_as_tensors
    from ..parallel.schedule import issue_collectives_early
    from ..transforms.remat_passes import order_recomputation
    from .inductor.masks import draw_masks_as_bytes
    from .rnn import keep_rnn_workspace
    from .split import remove_marker, split_at_optimizer

    # oneDNN's LSTM fills the workspace its backward reads only with grad mode on (rnn.py).
    keep_rnn_workspace(gm)

    # Collectives are traced after the whole backward; start each gradient reduction as soon
    # as its gradients exist, so it overlaps the rest of backward (on every rank alike).
    issue_collectives_early(gm)
    if backend == "eager":
        remove_marker(gm)
        views_that_may_copy(gm)
        return lambda args: gm(*args)
    sparse = [x for x in example_inputs if isinstance(x, Tensor) and x.layout != torch.strided]
    if sparse:
        return _with_sparse_inputs(gm, example_inputs, sparse, options)
    background = (
        background
        and fakes is None
        and not _collectives(gm)
        and not background_busy()
        and compile_worker.can_help(example_inputs)
    )
    # The graph as traced, for the steps before the background compile is ready (the passes
    # below rewrite gm for Inductor).
    traced = _as_traced(gm) if background else None
    # Dropout's masks kept for backward in 1 byte per element instead of 4, drawn in
    # eager's order also where dropout's input is strided (inductor/masks.py). Not for
    # the eager backend: it lays buffers out by the trace's strides, where eager's
    # empty_like follows the real input's (the two differ where a meta kernel is wrong),
    # and the eager backend keeps the float mask alive anyway.
    draw_masks_as_bytes(gm)
    order_recomputation(gm)  # Inductor would pull recomputations into forward
    bools_as_tensors(gm)  # Inductor cannot compile the SymBool of a returned bool
    split = split_at_optimizer(gm)
    remove_marker(gm)
    if split is None:
        graphs = [(gm, example_inputs)]

        def compile_here() -> Compiled:
            return compile_inductor(gm, example_inputs, fakes, options)

    else:
        update_examples = _update_examples(split, example_inputs)
        gradient_examples = [*example_inputs, *split.slots]
        graphs = [(split.gradients, gradient_examples), (split.update, update_examples)]

        def compile_here() -> Compiled:
            # A worker process compiles the update into Inductor's cache meanwhile.
            worker = compile_worker.start_worker(split.update, update_examples, options or {})
            try:
                gradient_fakes = fakes
                if fakes is not None and split.slots:
                    mode = next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))
                    slots = (mode.from_tensor(s, static_shapes=True) for s in split.slots)
                    gradient_fakes = [*fakes, *slots]
                # The split's graphs are made for this compile alone: no copy of them.
                gradients = compile_inductor(
                    split.gradients, gradient_examples, gradient_fakes, options, copy=False
                )
            except BaseException:
                if worker is not None:
                    worker.stop()
                raise
            if worker is not None:
                worker.finish()
            update = compile_inductor(split.update, update_examples, None, options, copy=False)
            return split.runner(gradients, update)

    workers = _background_workers(graphs, options or {}) if traced is not None else []
    if not workers:
        return compile_here()
    return BackgroundCompiled(lambda args: traced(*args), compile_here, workers)


def _with_sparse_inputs(
    gm: GraphModule,
    example_inputs: Sequence[Tensor],
    sparse: list[Tensor],
    options: dict[str, Any] | None,
) -> Compiled:
    """A step that takes sparse tensors (pytorch/examples' GCN passes its adjacency matrix
    as one): Inductor compiles dense tensors only (its capture reads every input's storage,
    which a sparse tensor has not), so forward and backward run op by op, as the eager
    backend runs them, and Inductor compiles the optimizer update, where all is dense."""
    from .split import remove_marker, split_at_optimizer

    split = split_at_optimizer(gm)
    remove_marker(gm)
    log.warning(
        "functacc: the step takes %s; Inductor compiles dense tensors only, so %s. Pass "
        "the tensor dense (x.to_dense()) to compile the whole step.",
        ", ".join(f"a {x.layout} tensor of shape {tuple(x.shape)}" for x in sparse),
        "the graph runs op by op (as backend='eager')"
        if split is None
        else "its forward and backward run op by op (as backend='eager'), the optimizer "
        "update compiled",
    )
    if split is None:
        views_that_may_copy(gm)
        return lambda args: gm(*args)
    gradients = split.gradients
    views_that_may_copy(gradients)
    update = compile_inductor(
        split.update, _update_examples(split, example_inputs), None, options, copy=False
    )
    return split.runner(lambda args: gradients(*args), update)


def _update_examples(split: Any, example_inputs: Sequence[Tensor]) -> list[Tensor]:
    """What the update graph of ``split`` takes, as examples."""
    return [*split.update_examples, *split.slots, *(example_inputs[i] for i in split.update_inputs)]


def _background_workers(
    graphs: list[tuple[GraphModule, Sequence[Tensor]]], options: dict[str, Any]
) -> list[compile_worker.CompileWorker]:
    """Workers compiling ``graphs`` (gradients, then update): an update large enough to be
    worth its own process gets one (ResNet-18, 2-core CPU: the compiled step in use 54.8 s
    after the start with one worker, 43.3 s with two), else one worker compiles them in
    turn. None where one cannot start."""
    if len(graphs) == 2 and len(graphs[1][0].graph.nodes) >= compile_worker.MIN_NODES:
        workers = [compile_worker.spawn([graph], options) for graph in graphs]
    else:
        workers = [compile_worker.spawn(graphs, options)]
    if None in workers:
        for worker in workers:
            if worker is not None:
                worker.stop()
        return []
    return workers


def _collectives(gm: GraphModule) -> bool:
    """Whether the graph talks to other ranks: their steps must run the same code, and each
    rank's compile would be ready at another step."""
    return any(
        getattr(node.target, "namespace", "") == "_c10d_functional" for node in gm.graph.nodes
    )


def _as_traced(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` that runs as the eager backend runs it (``gm`` itself unchanged)."""
    from .graph_transport import copy_graph
    from .split import remove_marker

    traced = GraphModule(gm, copy_graph(gm.graph))
    remove_marker(traced)
    views_that_may_copy(traced)
    return traced


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
    from ..parallel.comm import writers

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
