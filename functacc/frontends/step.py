"""``compile_step``'s step: the standard training step as an eager body, on ``jit``'s pipeline.

``compile_step(model, loss_fn, opt)`` writes the step eager PyTorch would write —
``zero_grad``, the forward and the loss per micro-batch, ``(loss / k).backward()``,
``clip_grad_norm_``, ``opt.step()`` (with ``precision=``, the AMP recipe with a
``GradScaler``) — and compiles it with :func:`functacc.jit`: SGD, Adam and AdamW by their
functional twins (:mod:`functacc.core.optimizers`), any other optimizer by tracing its own
``step()`` (:mod:`functacc.core.own_step`). After each call the model and the optimizer
hold what that eager step leaves there; ``.grad`` is ``None``: the body ends with
``zero_grad(set_to_none=True)``, so the gradients live only inside the graph (no copy out,
and every call has the signature of the first).

Example:
    >>> import torch, functacc
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    >>> step = functacc.compile_step(model, torch.nn.MSELoss(), opt, backend="eager")
    >>> loss = step(torch.randn(8, 4), torch.randn(8, 2))
    >>> type(step).__name__, step.num_traces
    ('Step', 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..backends import Backend
from ..core.cache import TraceRecord, as_call, warm_up
from ..parallel import TensorParallel, ZeRO
from ..parallel.comm import CommStats, comm_stats
from ..transforms.precision import Precision, resolve_precision
from .body_pure import PureForm
from .jit import build_jitted
from .step_fn import (
    LossFn,
    TrainState,
    check_grad_enabled,
    check_step_arguments,
    loss_modules,
    standard_body,
)

__all__ = ["Step"]


class Step:
    """The standard training step of ``model``, ``loss_fn`` and ``opt``; build it with
    :func:`functacc.compile_step`."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn | None,
        opt: torch.optim.Optimizer,
        *,
        backend: Backend,
        inductor_options: dict[str, Any] | None,
        grad_accum_steps: int,
        background_compile: bool = False,
        max_grad_norm: float | None,
        parallel: Any,
        cuda_graphs: bool | None,
        cuda_graph_cache_size: int = 8,
        dynamic: bool | None,
        max_traces: int | None,
        remat: Any = None,
        remat_policy: Any = "full",
        precision: Any = None,
    ):
        self.model = check_step_arguments(model, loss_fn, grad_accum_steps, max_grad_norm)
        self.loss_fn = loss_fn
        self.optimizer = opt
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.parallel = parallel
        self.precision = resolve_precision(precision)
        self.scaler = _grad_scaler(self.precision, self.model)
        self._calls = 0
        self._skipped: Tensor | None = None  # steps the scaler skipped, counted on the device
        try:  # the model's state as a TrainState (state, init_state(), apply())
            self._pure_form: PureForm | Exception = PureForm(self.model, opt, self.scaler)
        except ValueError as exc:  # an optimizer of a loss module's parameters too: the
            self._pure_form = exc  # step trains them; its pure form is refused when used
        self._jitted = build_jitted(
            standard_body(self.model, loss_fn, opt, self.scaler, self),
            modules=[self.model, *loss_modules(loss_fn, self.model)],
            optimizers=[opt],
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
            what="the training step",
            door="compile_step",
            scalers={"scaler": self.scaler} if self.scaler is not None else None,
            stacklevel=5,  # compile_step's caller
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """One training step; returns the loss, a detached 0-dim tensor."""
        if self.loss_fn is not None and (len(args) != 2 or kwargs):
            raise TypeError(
                "a step with a loss_fn is called as step(inputs, targets); got "
                f"{len(args)} positional and {len(kwargs)} keyword arguments"
            )
        check_grad_enabled()
        out = self._jitted(*args, **kwargs)
        self._calls += 1
        if self.scaler is None:
            return out
        loss, skipped = out  # counted outside the graph: one small op, no host sync
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        return loss

    @property
    def loss_scale(self) -> float | None:
        """The current float16 loss scale (``None`` without loss scaling). Reading it waits
        for the device."""
        return self.scaler.get_scale() if self.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because their float16 gradients overflowed."""
        return int(self._skipped) if self._skipped is not None else 0

    @property
    def backend(self) -> Backend:
        return self._jitted._engine.engine.backend

    @property
    def num_traces(self) -> int:
        """Graphs traced and compiled so far."""
        return self._jitted.num_traces

    def wait_for_compile(self) -> float:
        """With ``background_compile=True``: wait for the compiles still running in the
        background, and run the compiled code from the next call on (a fixed step for the
        swap, where a run must repeat bit for bit); returns the seconds waited."""
        return self._jitted.wait_for_compile()

    @property
    def traces(self) -> list[TraceRecord]:
        """Every compiled trace: why it happened, which sizes it made symbolic, its cost."""
        return self._jitted.traces

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        return self._jitted.graphs

    @property
    def count(self) -> int:
        """Steps taken."""
        return self._calls

    @property
    def state(self) -> TrainState:
        """The live training state: the model's own tensors and the optimizer's (see
        :mod:`functacc.frontends.body_pure` for the optimizer state's form)."""
        self._check_pure("state")
        return self._pure.read(self._calls, copy=False)

    def init_state(self) -> TrainState:
        """A copy of the current training state for :meth:`apply`; later calls of the
        stateful step do not change it."""
        self._check_pure("init_state()")
        return self._pure.read(self._calls, copy=True)

    def apply(self, state: TrainState, *args: Any, **kwargs: Any) -> tuple[TrainState, Tensor]:
        """The pure step: ``(new_state, loss)``; mutates nothing, not even ``state``. The
        hyperparameters are the optimizer's current ``param_groups`` values."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"apply() expects the TrainState from init_state() or a previous apply(); got "
                f"{type(state).__name__}"
            )
        self._check_pure("apply()")
        if set(state.params) != set(self._pure.params):
            raise ValueError(
                "apply() expects a TrainState of this model's parameters; "
                f"missing {sorted(set(self._pure.params) - set(state.params))}, "
                f"unknown {sorted(set(state.params) - set(self._pure.params))}. "
                "Start from step.init_state()."
            )
        saved, calls, skipped = self._pure.save(), self._calls, self._skipped
        try:
            self._pure.write(state)
            loss = self(*args, **kwargs)
            return self._pure.read(int(state.count) + 1, copy=True), loss
        finally:  # also when the step fails: the model and the optimizer as they were
            self._pure.restore(saved)
            self._calls, self._skipped = calls, skipped

    @property
    def _pure(self) -> PureForm:
        if isinstance(self._pure_form, Exception):
            raise self._pure_form
        return self._pure_form

    def _check_pure(self, what: str) -> None:
        from ..parallel.mesh import world_size

        if isinstance(self.parallel, ZeRO) and world_size() > 1:
            raise ValueError(
                f"step.{what} of a ZeRO step on {type(self.optimizer).__name__} (on "
                "functacc.jit's pipeline) is not supported: each rank holds a shard. Use "
                "step(...) and step.sync_model(), or data parallel (parallel=None)."
            )

    def warmup(self, batches: Iterable[Any], *, progress: bool = True) -> list[TraceRecord]:
        """Trace and compile the step for each batch's signature before training, as
        :meth:`functacc.Jitted.warmup`; nothing runs."""
        with_targets = self.loss_fn is not None
        return warm_up(
            self._jitted._engine.cache,
            batches,
            lambda batch: self._jitted._engine.program(*as_call(batch, with_targets=with_targets)),
            progress=progress,
        )

    def stats(self) -> dict[str, Any]:
        """What the last step communicated and what this rank holds.

        ``collectives`` and ``payload_bytes`` per kind (``all_reduce``, ``reduce_scatter``,
        ``all_gather``) are read off the compiled graph; ``sent_bytes`` estimates what this
        rank sends on a ring. ``memory`` gives the bytes this rank holds between steps for
        ``params``, ``grads`` (0: gradients live only inside the step) and ``optimizer``.
        ``tensor_parallel_bytes``: the payload of the tensor-parallel group's collectives
        (0 without :class:`~functacc.parallel.TensorParallel`)."""
        from ..parallel.mesh import world_size

        program = self._jitted._engine.last_program
        comm = comm_stats(program.graph) if program is not None else CommStats()
        world = world_size()
        # With TensorParallel, parallel is a list: the strategy across its groups is the other.
        across = (
            [p for p in self.parallel if not isinstance(p, TensorParallel)]
            if isinstance(self.parallel, (list, tuple))
            else [self.parallel]
        )
        zero = next((p for p in across if isinstance(p, ZeRO)), None)
        layout = getattr(self.model, "_functacc_tensor_parallel", None)
        replicas = world // layout.size if layout is not None else world
        if zero is not None:
            name = f"ZeRO-{zero.stage}"
            shard = zero.shard_size
            if shard and replicas > shard:  # sharded within groups, replicated across them
                name += f" (hybrid: {replicas // shard} x {shard})"
        else:
            name = "data parallel" if replicas > 1 else "single process"
        tp_bytes = 0
        if layout is not None:
            tp_name = f"tensor parallel (size {layout.size})"
            name = f"{tp_name} x {name} ({replicas})" if replicas > 1 else tp_name
            group = layout.group
            tp_bytes = comm.group_bytes.get(group.group_name, 0) if group is not None else 0
        capture = self._jitted._engine.capture
        rest = capture.rest  # ZeRO-3: the parameters this rank keeps are chunks
        params = [p for n, p in capture.params.items() if rest is None or n not in rest.names]
        params += list(rest.chunks.values()) if rest is not None else []
        state = [t for linked in capture.optimizers for t in linked.leaves()[1]]
        return {
            "strategy": name,
            "world_size": world,
            "collectives": dict(comm.collectives),
            "payload_bytes": dict(comm.payload_bytes),
            "sent_bytes": dict(comm.sent_bytes),
            "tensor_parallel_bytes": tp_bytes,
            "memory": {
                "params": _nbytes(params),
                "grads": 0,
                "optimizer": _nbytes(state),
                "buffers": _nbytes(list(self.model.buffers())),
            },
        }

    def sync_model(self) -> nn.Module:
        """The model, holding the trained parameters (under ZeRO-3 gathered into it: a
        collective call, every rank makes it; elsewhere it holds them after every call)."""
        self._jitted.sync_modules()
        return self.model


def _grad_scaler(precision: Precision | None, model: nn.Module) -> torch.amp.GradScaler | None:
    """float16's dynamic loss scaling: a ``torch.amp.GradScaler`` of the same settings."""
    if precision is None or not precision.loss_scaling:
        return None
    device = next((p.device.type for p in model.parameters()), "cpu")
    return torch.amp.GradScaler(
        device,
        init_scale=precision.init_scale,
        growth_factor=precision.growth_factor,
        backoff_factor=precision.backoff_factor,
        growth_interval=precision.growth_interval,
    )


def _nbytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
