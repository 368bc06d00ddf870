"""``compile_step``: the whole training step as one traced, compiled pure function.

The step is traced once per input signature with fake tensors, compiled, and replayed.
Two forms share the same mathematics (:mod:`functacc.frontends.step_fn`):

- ``step(inputs, targets)`` updates the model's own tensors and the ``torch.optim``
  optimizer's own state in place (the graph's last ops write into them), so the rest of a
  PyTorch program (saving, evaluation, export, ``opt.state_dict()``) keeps working;
- ``step.apply(state, inputs, targets) -> (new_state, loss)`` is pure: it mutates nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .._env import env_flag
from ..backends import (
    Backend,
    check_backend,
    check_background,
    check_cuda_graphs,
    check_inductor_options,
    keep_freed_memory,
)
from ..backends.cudagraph import check_cache_size
from ..backends.host_memory import ENV_VAR as HOST_MEMORY_ENV
from ..core.cache import TraceRecord, as_call, warm_up
from ..core.engine import Engine
from ..core.functional import check_dense_gradients, tensor_attributes
from ..core.signature import TensorSpec
from ..optim import GradientTransformation
from ..optim._torch import _check_supported
from ..parallel import resolve_strategy
from ..parallel.comm import CommStats
from ..parallel.strategy import check_same_model, sync_from_rank0
from ..parallel.tp_setup import TensorParallelSetup, split_parallel
from ..transforms.precision import resolve_precision
from ..transforms.remat import RematPolicy, validate_remat
from .step_fn import LossFn, StepFunction, TrainState, check_grad_enabled, check_step_arguments
from .step_programs import StepProgram, StepPrograms
from .step_signature import StepSignature, describe_batch
from .step_state import LiveState

__all__ = ["Step", "TrainState"]

log = logging.getLogger("functacc")


_tensor_key = TensorSpec.of


class Step:
    """A compiled training step; build it with :func:`compile_step`.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
        >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
        >>> loss.shape, step.num_traces
        (torch.Size([]), 1)
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn | None,
        opt: torch.optim.Optimizer | GradientTransformation,
        *,
        backend: Backend = "inductor",
        inductor_options: dict[str, Any] | None = None,
        background_compile: bool = False,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        parallel: Any = None,
        precision: Any = None,
        remat: Collection[str] | None = None,
        remat_policy: RematPolicy = "full",
        cuda_graphs: bool | None = None,
        dynamic: bool | None = None,
        max_traces: int | None = 32,
        cuda_graph_cache_size: int = 8,
    ):
        model = check_step_arguments(model, loss_fn, grad_accum_steps, max_grad_norm)
        check_backend(backend)
        check_background(background_compile, backend)
        keep_host_memory = env_flag(HOST_MEMORY_ENV, True)  # a bad value fails before any work
        _check_supported(opt)
        check_dense_gradients(model)
        self.model = model
        self.loss_fn = loss_fn
        self.inductor_options = check_inductor_options(inductor_options, backend)
        self.grad_accum_steps = grad_accum_steps
        tensor_parallel, parallel = split_parallel(parallel)
        if tensor_parallel is not None:  # the model keeps its slices from here on
            torch_opts = [opt] if isinstance(opt, torch.optim.Optimizer) else []
            tensor_parallel = TensorParallelSetup.build(tensor_parallel, [model], torch_opts)
        self._params: dict[str, Tensor] = dict(model.named_parameters())
        self._buffers: dict[str, Tensor] = dict(model.named_buffers())
        self._engine = Engine(
            "the training step",
            backend=backend,
            holder=model,
            inductor_options=self.inductor_options,
            dynamic=dynamic,
            max_traces=max_traces,
            background=background_compile,
        )
        self._cache = self._engine.cache
        self._calls = 0

        link = LiveState.link_for(opt, self._params)
        groups = link.groups if link else None
        self._strategy = resolve_strategy(parallel, model, groups, tensor_parallel)
        self._distributed = self._strategy.topology.world > 1
        if self._distributed and tensor_parallel is None:  # (the split synced the model)
            # A collective call: every rank builds its step at the same point of its program.
            check_same_model(self._params, "parameter")
            check_same_model(self._buffers, "buffer")
            sync_from_rank0({**self._params, **self._buffers})
        self.precision = resolve_precision(precision)
        self._device = next((t.device for t in self._params.values()), torch.device("cpu"))
        self._signature = StepSignature(model, self._params, self._buffers, self._device.type)
        cuda_graphs = check_cuda_graphs(
            cuda_graphs, self._device, dist.get_backend_config() if self._distributed else None
        )
        check_cache_size(cuda_graph_cache_size)
        self._state = LiveState(
            opt, link, self._params, self._buffers, self._strategy, self.precision, self._device
        )
        self._fn = StepFunction(
            model,
            loss_fn,
            self._state.transform(),
            self._strategy,
            grad_accum_steps,
            max_grad_norm,
            self.precision,
            validate_remat(model, remat, remat_policy),
        )
        self.remat_policy = remat_policy
        self._programs = StepPrograms(
            self._engine,
            self._signature,
            self._fn,
            self._state,
            tensor_attributes(model),
            self._state_key,
            with_targets=loss_fn is not None,
            remat_policy=remat_policy,
            cuda_graphs=cuda_graphs,
            cuda_graph_cache_size=cuda_graph_cache_size,
        )
        self._state.start(self._fn)
        if keep_host_memory and self._device.type == "cpu":
            # Last, so that a step that fails to build changes nothing in the process.
            keep_freed_memory()

    # -- public ------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """What the step compiles with: ``"inductor"`` or ``"eager"``."""
        return self._engine.backend

    @property
    def num_traces(self) -> int:
        """How many times the step has been traced (once per new input signature)."""
        return self._cache.num_traces

    def wait_for_compile(self) -> float:
        """Wait for the background compiles (``background_compile=True``): the compiled
        code runs from the next call on; returns the seconds waited."""
        return self._engine.wait_for_compile()

    @property
    def traces(self) -> list[TraceRecord]:
        """Every trace so far: why it happened (what changed), which dimensions it made
        symbolic, and its trace and compile time in seconds."""
        return list(self._cache.records)

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """The traced graphs, oldest first (for inspection), as ``functacc.jit``'s."""
        return [p.graph for p in self._cache.programs()]

    @property
    def count(self) -> int:
        """Steps taken by the stateful form."""
        return self._calls

    @property
    def loss_scale(self) -> float | None:
        """The current float16 loss scale (``None`` without loss scaling). Reading it waits
        for the device."""
        scaler = (self._state.state.extra or {}).get("loss_scale")
        return float(scaler["scale"]) if scaler else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because their float16 gradients overflowed."""
        scaler = (self._state.state.extra or {}).get("loss_scale")
        return int(scaler["skipped"]) if scaler else 0

    @property
    def state(self) -> TrainState:
        """The live training state of the stateful form. Its tensors are the ones the step
        updates in place (the model's own parameters, unless sharded)."""
        return self._state.state

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """One training step that updates the model and the optimizer in place.

        With a ``loss_fn``: ``step(inputs, targets)``; without: ``step(*args, **kwargs)``
        calls ``model(*args, **kwargs)``. Returns the loss, a detached 0-dim tensor.
        """
        program, tensors = self._stateful_program(args, kwargs)
        inputs = [*self._state.leaves, *tensors]
        loss = self._engine.run(program, inputs, lambda: describe_batch(args, kwargs))[0]
        self._calls += 1
        self._last_program = program
        self._state.stepped(program.names_with_grads)
        return loss

    def warmup(self, batches: Iterable[Any], *, progress: bool = True) -> list[TraceRecord]:
        """Trace and compile the step for each batch's signature before training.

        Each batch is given as the step takes it: ``(inputs, targets)`` with a ``loss_fn``;
        without one, a dict (``step(**batch)``), a tuple (``step(*batch)``) or a tensor.
        Batches whose signature already has a graph cost nothing. Nothing runs: the model,
        optimizer, RNG and step count are unchanged. Returns the new traces (with their
        compile times); ``progress`` shows a tqdm bar.

        Example:
            >>> import torch, functacc
            >>> model = torch.nn.Linear(4, 2)
            >>> step = functacc.compile_step(model, torch.nn.MSELoss(),
            ...     torch.optim.SGD(model.parameters(), lr=0.1), backend="eager", dynamic=False)
            >>> shapes = [(torch.randn(n, 4), torch.randn(n, 2)) for n in (8, 16)]
            >>> len(step.warmup(shapes, progress=False)), step.count
            (2, 0)
        """
        with_targets = self.loss_fn is not None
        return warm_up(
            self._cache,
            batches,
            lambda batch: self._stateful_program(*as_call(batch, with_targets=with_targets)),
            progress=progress,
        )

    def init_state(self) -> TrainState:
        """A copy of the current training state (model, optimizer, step count) for
        :meth:`apply`. Later calls of the stateful step do not change it."""
        return pytree.tree_map(
            lambda x: x.detach().clone() if isinstance(x, Tensor) else x, self._state.state
        )

    def apply(self, state: TrainState, *args: Any, **kwargs: Any) -> tuple[TrainState, Tensor]:
        """The pure step: ``(new_state, loss)``; mutates nothing, not even ``state``.

        With a ``torch.optim`` optimizer, hyperparameters (lr, momentum, betas, ...) are
        its current ``param_groups`` values, as in the stateful form.
        """
        if not isinstance(state, TrainState):
            raise TypeError(
                f"apply() expects the TrainState from init_state() or a previous apply(); got "
                f"{type(state).__name__}"
            )
        self._check_call(args, kwargs)
        self._strategy.release_model_params(self._params)  # after sync_model (ZeRO-3)
        link = self._state.link
        if link is not None:
            state = state._replace(opt_state=link.with_current_hyperparams(state.opt_state))
        leaves, spec = pytree.tree_flatten(state)
        state_key = (spec, tuple(_tensor_key(t) for t in leaves))
        count = int(state.count) if self._strategy.signature(0) != () else 0
        context = ("pure", self._state_key(count), ("state", state_key))
        programs = self._programs
        program, tensors = programs.program(
            context, state, args, kwargs, inplace=False, count=count
        )
        outputs = self._engine.run(
            program, [*leaves, *tensors], lambda: describe_batch(args, kwargs)
        )
        self._last_program = program
        new = iter(outputs[1:])
        new_leaves = [next(new) if c else t for t, c in zip(leaves, program.changed, strict=True)]
        return pytree.tree_unflatten(new_leaves, spec), outputs[0]

    def stats(self) -> dict[str, Any]:
        """What the last step communicated and what this rank holds.

        ``collectives`` and ``payload_bytes`` per kind (``all_reduce``, ``reduce_scatter``,
        ``all_gather``) are read off the compiled graph; ``sent_bytes`` estimates what this
        rank sends on a ring. ``memory`` gives the bytes this rank holds between steps for
        ``params``, ``grads`` (0: gradients live only inside the step) and ``optimizer``.
        ``tensor_parallel_bytes``: the payload of the tensor-parallel group's collectives
        (0 without :class:`~functacc.parallel.TensorParallel`).
        """
        program = getattr(self, "_last_program", None)
        comm = program.stats if program is not None and program.stats else CommStats()
        return {
            "strategy": self._strategy.name,
            "world_size": self._strategy.topology.world,
            "collectives": dict(comm.collectives),
            "payload_bytes": dict(comm.payload_bytes),
            "sent_bytes": dict(comm.sent_bytes),
            "tensor_parallel_bytes": comm.group_bytes.get(self._tensor_parallel_group(), 0),
            "memory": {
                "params": _nbytes(self._state.state.params),
                "grads": 0,
                "optimizer": _nbytes(self._state.state.opt_state),
                "buffers": _nbytes(self._state.state.buffers),
            },
        }

    def _tensor_parallel_group(self) -> str:
        layout = self._strategy.tensor_parallel
        group = layout.group if layout is not None else None
        return group.group_name if group is not None else ""

    def sync_model(self) -> nn.Module:
        """Make ``model`` hold the full trained parameters on every rank (ZeRO-3 gathers
        them, a collective call; otherwise the model already holds them) and return it.
        Under ZeRO-3 the next step drops these full copies again (the model's parameters
        go back to empty placeholders) without retracing."""
        self._strategy.write_model_params(self._state.state.params, self._params)
        return self.model

    def _state_key(self, count: int) -> tuple:
        hyper = self._state.hyper_key
        return self._signature.context(hyper=hyper, parallel=self._strategy.signature(count))

    # -- programs ----------------------------------------------------------------------
    def _stateful_program(self, args: tuple, kwargs: dict) -> tuple[StepProgram, list[Tensor]]:
        """The program for a call of the stateful step (traced and compiled if new)."""
        self._check_call(args, kwargs)
        self._strategy.release_model_params(self._params)  # after sync_model (ZeRO-3)
        self._state.refresh()
        context = ("inplace", self._state_key(self._calls))
        state = self._state.state
        return self._programs.program(context, state, args, kwargs, inplace=True, count=self._calls)

    # -- batches -----------------------------------------------------------------------
    def _check_call(self, args: tuple, kwargs: dict) -> None:
        self._signature.check_structure()
        if self._distributed and not dist.is_initialized():
            raise RuntimeError(
                f"this step trains with {self._strategy.name} over "
                f"{self._strategy.topology.world} ranks, but the process group has been "
                "destroyed (dist.destroy_process_group()). Build the step again after "
                "functacc.init_distributed()."
            )
        check_grad_enabled()
        if self.loss_fn is not None and (len(args) != 2 or kwargs):
            raise TypeError(
                "with a loss_fn the step is called as step(inputs, targets); got "
                f"{len(args)} positional and {len(kwargs)} keyword arguments. Pack several "
                "model inputs into a tuple or dict: step((x1, x2), targets)."
            )


def _nbytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)
    )
