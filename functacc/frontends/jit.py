"""``functacc.jit``: any training step, traced once into one graph and compiled.

Two forms, one engine (:mod:`functacc.core`):

- **imperative**: ``jit(fn, modules=(...), optimizers=(...))`` where ``fn`` is the body of
  an ordinary eager training step: forward passes, ``loss.backward()``,
  ``torch.autograd.grad`` (``create_graph=True`` too), ``opt.step()``, ``opt.zero_grad()``,
  in-place updates under ``torch.no_grad()``, reading ``p.grad``. After each call the
  modules, ``.grad`` and the optimizers hold what the eager step leaves there.
- **pure**: ``jit(pure_fn, donate=(0,))`` for ``pure_fn(state, batch) -> (new_state,
  out)`` over pytrees of tensors, written with ``torch.func`` and :mod:`functacc.optim`;
  ``donate`` lets the outputs reuse the donated arguments' memory (JAX's
  ``donate_argnums``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._env import env_flag
from ..backends import (
    Backend,
    check_backend,
    check_background,
    check_cuda_graphs,
    check_inductor_options,
)
from ..backends.cudagraph import check_cache_size
from ..backends.host_memory import ENV_VAR as HOST_MEMORY_ENV
from ..backends.host_memory import keep_freed_memory
from ..core.body import StepBody
from ..core.cache import TraceRecord, as_call, warm_up
from ..core.capture import Capture
from ..core.functional import refuse_script_modules
from ..core.grad_scaler import hold_grad_scaler
from ..core.held_objects import unwrapped
from ..parallel.jit_strategy import jit_strategy
from ..parallel.mesh import world_size
from ..parallel.tp_setup import TensorParallelSetup, split_parallel
from ..transforms.remat import RematPolicy, validate_remat
from ..transforms.remat_passes import Recompute

__all__ = ["Jitted", "jit"]


class Jitted:
    """A step body compiled by :func:`jit`; call it as you would call the body.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def train_step(x, y):
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        ...     return loss
        >>> step = functacc.jit(train_step, modules=[model], optimizers=[opt], backend="eager")
        >>> losses = [step(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
        >>> step.num_traces, model.weight.grad is not None
        (1, True)
    """

    def __init__(self, fn: Callable[..., Any], engine: StepBody, ranks: int = 0):
        self.fn = fn
        self._engine = engine
        self._ranks = ranks  # > 0: the step's graphs communicate over that many ranks
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._ranks and not dist.is_initialized():
            raise RuntimeError(
                f"this step trains over {self._ranks} ranks, but the process group has been "
                "destroyed (dist.destroy_process_group()). Build the step again after "
                "functacc.init_distributed()."
            )
        return self._engine(args, kwargs)

    @property
    def num_traces(self) -> int:
        """Graphs traced and compiled so far (one per new signature; a signature whose
        graph is identical to a compiled one reuses it and does not count)."""
        return self._engine.cache.num_traces

    @property
    def traces(self) -> list[TraceRecord]:
        """Every compiled trace: why it happened, which sizes it made symbolic, its cost."""
        return list(self._engine.cache.records)

    def wait_for_compile(self) -> float:
        """With ``background_compile=True``: wait for the compiles still running in the
        background, and run the compiled code from the next call on (a fixed step for the
        swap, where a run must repeat bit for bit); returns the seconds waited."""
        return self._engine.engine.wait_for_compile()

    def warmup(self, batches: Iterable[Any], *, progress: bool = True) -> list[TraceRecord]:
        """Trace and compile the step for each batch's signature before training; nothing
        runs (modules, optimizers, RNG and the body's Python state are unchanged).

        Each batch is given as the step takes it: a tuple (``step(*batch)``), a dict
        (``step(**batch)``) or one tensor. Returns the new traces; ``progress`` shows a
        tqdm bar.

        Example:
            >>> import torch, functacc
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> def train_step(x, y):
            ...     opt.zero_grad()
            ...     torch.nn.functional.mse_loss(model(x), y).backward()
            ...     opt.step()
            >>> step = functacc.jit(train_step, modules=[model], optimizers=[opt],
            ...                     backend="eager", dynamic=False)
            >>> shapes = [(torch.randn(n, 4), torch.randn(n, 1)) for n in (8, 16)]
            >>> len(step.warmup(shapes, progress=False)), model.weight.grad is None
            (2, True)
        """
        return warm_up(
            self._engine.cache,
            batches,
            lambda batch: self._engine.program(*as_call(batch, with_targets=False)),
            progress=progress,
        )

    def sync_modules(self) -> None:
        """Under ``parallel=ZeRO(3)``: put the whole trained parameters back into the
        modules, which hold empty placeholders between calls (a collective call: every rank
        makes it), for code outside the step (evaluation, ``state_dict()``). The next call
        shards them again from what the modules then hold. Elsewhere: nothing to do."""
        rest = self._engine.capture.rest
        if rest is not None:
            rest.gather_modules()

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """The traced graphs, oldest first (for inspection)."""
        return [p.graph for p in self._engine.cache.programs()]


def jit(
    fn: Callable[..., Any],
    *,
    modules: nn.Module | Iterable[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
    donate: Collection[int] = (),
    backend: Backend = "inductor",
    inductor_options: dict[str, Any] | None = None,
    background_compile: bool = False,
    dynamic: bool | None = None,
    max_traces: int | None = 32,
    parallel: Any = None,
    cuda_graphs: bool | None = None,
    cuda_graph_cache_size: int = 8,
    remat: Collection[str] | None = None,
    remat_policy: RematPolicy = "full",
) -> Jitted:
    """Compile a whole training step, written as eager code or as a pure function.

    Args:
        fn: the step body. It may use the given modules and optimizers as eager code does
            and take any pytree of tensors and Python values; it returns a pytree (tensors
            come back detached).
        modules: every module whose parameters, buffers or ``.grad`` the body reads or
            writes (a student and its frozen teacher, a generator and a discriminator, an
            EMA copy), or one module. Their state is read on every call; nothing is
            baked in.
        optimizers: the optimizers the body steps (or one): any ``torch.optim.Optimizer``
            but LBFGS and SparseAdam (SGD, Adam and AdamW run functacc's twins, others their own
            ``step()``, traced; docs/optimizers.md); their state and ``param_groups`` stay
            live (schedules do not retrace). A ``torch.amp.GradScaler`` the body holds
            steps them inside the graph (docs/jit.md, "Mixed precision").
        donate: positions of arguments whose tensors the call may reuse for its outputs
            (the pure form's ``state``): afterwards reading them is an error.
        backend: ``"inductor"`` (fused kernels) or ``"eager"`` (the traced graph run op by
            op: bit for bit as eager PyTorch, dropout included).
        inductor_options: ``torch._inductor.config`` settings for this step's compiles.
        background_compile: Inductor compiles each new graph in a worker process while
            the calls run the graph as traced (at about eager speed); the compiled code
            takes over at the first call after it is ready (docs/benchmarks.md, "Time to the
            first step"). For static graphs on CPU, one process; elsewhere the graph compiles first.
        dynamic: symbolic sizes: ``None`` (automatic: after a size changes), ``True`` (from
            the first call) or ``False`` (one graph per shape).
        max_traces: the most graphs to compile before :class:`functacc.RetraceError`.
        parallel: under ``torchrun`` (world size > 1), ``None`` or
            :class:`functacc.parallel.DataParallel`: every ``backward()`` averages the
            gradients it adds to the modules' ``.grad`` over the ranks, in bucketed
            all-reduces inside the graph, before anything reads them (DDP's semantics);
            written buffers (BatchNorm statistics) are averaged at the end of the step. The
            modules start from rank 0's weights. Each rank passes its own part of the batch.
            ``functacc.parallel.ZeRO(1)``: the same, and each optimizer keeps and updates
            only this rank's shard of its state, all-gathering the new parameters
            (:mod:`functacc.parallel.zero_jit`). ``ZeRO(2)``: the optimizers' parameters'
            gradients are reduce-scattered instead, each rank receiving its shard; a body
            may still read them whole (they are gathered for it), but they do not outlive
            the call: their ``.grad`` is ``None`` afterwards, and a body that reads the
            ``.grad`` a previous call left (accumulating over calls) is an error.
            ``ZeRO(3)``: also the optimizers' parameters, kept as this rank's chunks
            between calls (the modules hold empty placeholders; :meth:`Jitted.sync_modules`
            puts them back whole) and gathered inside the step where first read and again
            in backward (:mod:`functacc.parallel.zero3_jit`).

        cuda_graphs: capture each compiled step as a CUDA graph and replay it (the batch
            is copied into static buffers, the outputs out). ``None``: on where the step's
            tensors are on CUDA (and, under torchrun, its collectives are NCCL's); ``True``
            elsewhere is an error.
        cuda_graph_cache_size: CUDA graphs kept per compiled graph (one per concrete size
            of a graph with symbolic sizes), least recently used evicted.
        remat: class names of modules (in any of ``modules``) whose activations are
            recomputed in backward instead of kept, as ``compile_step(remat=)`` does: each
            outermost such module runs under non-reentrant checkpointing inside the trace,
            its dropout masks replayed, so the gradients equal those of the kept
            activations. ``remat_policy``: ``"full"``, ``"save_matmuls"`` or
            ``"selective"`` (see docs/precision.md).

    A tensor the body reads that is none of these (a module not in ``modules``, a global
    tensor) is an error naming the op, never a constant baked into the graph. Python side
    effects run once, when the body is traced.

    On CPU (with glibc), building a step makes ``malloc`` keep freed memory for the next
    step, as ``compile_step`` does (``FUNCTACC_KEEP_HOST_MEMORY=0`` turns it off; see
    :mod:`functacc.host_memory`).

    Example (pure form):
        >>> import torch, functacc
        >>> def sgd_step(state, x):
        ...     grad = torch.func.grad(lambda w: (x @ w).pow(2).mean())(state["w"])
        ...     return {"w": state["w"] - 0.1 * grad}, grad.norm()
        >>> step = functacc.jit(sgd_step, donate=(0,), backend="eager")
        >>> state = {"w": torch.ones(3)}
        >>> state, norm = step(state, torch.randn(8, 3))
        >>> state["w"].shape
        torch.Size([3])
    """
    return build_jitted(
        fn,
        modules=modules,
        optimizers=optimizers,
        donate=donate,
        backend=backend,
        inductor_options=inductor_options,
        background_compile=background_compile,
        dynamic=dynamic,
        max_traces=max_traces,
        parallel=parallel,
        cuda_graphs=cuda_graphs,
        cuda_graph_cache_size=cuda_graph_cache_size,
        remat=remat,
        remat_policy=remat_policy,
    )


def build_jitted(
    fn: Callable[..., Any],
    *,
    modules: Any,
    optimizers: Any,
    donate: Collection[int] = (),
    backend: Backend,
    inductor_options: dict[str, Any] | None,
    background_compile: bool,
    dynamic: bool | None,
    max_traces: int | None,
    parallel: Any,
    cuda_graphs: bool | None,
    cuda_graph_cache_size: int = 8,
    remat: Collection[str] | None = None,
    remat_policy: RematPolicy,
    what: str | None = None,
    door: str = "functacc.jit",
    scalers: dict[str, torch.amp.GradScaler] | None = None,
    stacklevel: int = 4,
) -> Jitted:
    """:func:`jit`, for a front door that writes the body itself (``compile_step``):
    ``what`` names the step in messages and retrace reasons, ``door`` is the call that
    builds it again, ``scalers`` are GradScalers the body holds by name (functacc's own
    code, whose closure the body's Python scan does not read); ``stacklevel`` makes
    warnings point at the user's call (4: ``jit(...)``'s caller)."""
    if not callable(fn):
        raise TypeError(f"jit() takes a callable step body; got {type(fn).__name__}")
    check_backend(backend)
    keep_host_memory = env_flag(HOST_MEMORY_ENV, True)  # a bad value fails before any work
    options = check_inductor_options(inductor_options, backend)
    check_background(background_compile, backend)
    # One module is one module, not the children it iterates over (nn.Sequential does).
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"modules[{i}] must be a torch.nn.Module; got {type(m).__name__}")
        refuse_script_modules(m, f"modules[{i}]")
        if any(isinstance(sub, nn.parallel.DistributedDataParallel) for sub in m.modules()):
            raise TypeError(
                f"modules[{i}] is (or holds) a DistributedDataParallel, whose forward "
                "prepares its gradient hooks on the host at every call. functacc does the "
                "data parallelism itself (parallel=DataParallel(), the default under "
                "torchrun): every backward() averages the gradients over the ranks, as DDP "
                "does. Fix: give the module DDP wraps (ddp.module) and call it in the step "
                "in place of the wrapper (buffers such as BatchNorm's are averaged at the "
                "end of the step, where DDP broadcasts rank 0's before each forward)."
            )
    for i, o in enumerate(optimizers):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"optimizers[{i}] must be a torch.optim.Optimizer; got {type(o).__name__}"
            )
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be None, True or False; got {cuda_graphs!r}")
    check_cache_size(cuda_graph_cache_size)
    params = [p for m in modules for p in m.parameters()]
    if cuda_graphs and params:  # the pure form's device is known at its first call
        check_cuda_graphs(True, params[0].device)
    donated = frozenset(donate)
    if any(not isinstance(i, int) or i < 0 for i in donated):
        raise ValueError(f"donate must hold argument positions (ints >= 0); got {donate!r}")
    labels = _labels(fn, modules, "modules")
    opt_labels = _labels(fn, optimizers, "optimizers")
    optimizers = [unwrapped(o) for o in optimizers]  # Accelerate's wrapper: its optimizer
    holder = nn.ModuleDict(dict(zip(labels, modules, strict=True)))
    recomputed = validate_remat(holder, remat, remat_policy, stacklevel=stacklevel)
    tensor_parallel, parallel = split_parallel(parallel)
    if tensor_parallel is not None:  # the modules keep their slices from here on
        tensor_parallel = TensorParallelSetup.build(tensor_parallel, modules, optimizers)
    capture = Capture(modules, labels, optimizers, opt_labels, door=door)
    capture.strategy = jit_strategy(parallel, capture, tensor_parallel)
    engine = StepBody(
        fn,
        capture,
        backend=backend,
        inductor_options=options,
        background=background_compile,
        dynamic=dynamic,
        max_traces=max_traces,
        donate=donated,
        what=what or f"the jitted step {getattr(fn, '__qualname__', 'fn')}",
        cuda_graphs=cuda_graphs,
        cuda_graph_cache_size=cuda_graph_cache_size,
        remat=Recompute(holder, recomputed, remat_policy) if recomputed else None,
    )
    for name, scaler in (scalers or {}).items():
        hold_grad_scaler(engine, name, scaler)
    if keep_host_memory and all(p.device.type == "cpu" for p in params):
        # Last, so that a step that fails to build changes nothing in the process.
        keep_freed_memory()
    ranks = world_size() if capture.strategy is not None else 0
    return Jitted(fn, engine, ranks if ranks > 1 else 0)


def _labels(fn: Callable[..., Any], objects: list[Any], what: str) -> list[str]:
    """Names for the objects in messages: the body's own names for them (its closure and
    globals), else ``modules[i]``."""
    known: dict[int, str] = {}
    try:
        closure = inspect.getclosurevars(fn)
        scopes = [closure.nonlocals, closure.globals]
    except (TypeError, ValueError):
        scopes = []
    for scope in scopes:
        for name, value in scope.items():
            known.setdefault(id(value), name)
    labels = []
    for i, obj in enumerate(objects):
        label = known.get(id(obj), f"{what}[{i}]")
        if label in labels or not label.isidentifier():
            label = f"{what}_{i}"
        if hasattr(nn.ModuleDict(), label):  # a model named `forward`, `training`, `modules`
            label += "_"
        labels.append(label)
    return labels
