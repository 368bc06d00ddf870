"""``compile_step``: the whole training step as one traced, compiled pure function.

The step is traced once per input signature with fake tensors, compiled, and replayed.
Two forms share the same mathematics (:mod:`functacc.step_fn`):

- ``step(inputs, targets)`` updates the model's own tensors and the ``torch.optim``
  optimizer's own state in place (the graph's last ops write into them), so the rest of a
  PyTorch program (saving, evaluation, export, ``opt.state_dict()``) keeps working;
- ``step.apply(state, inputs, targets) -> (new_state, loss)`` is pure: it mutates nothing.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ._env import env_flag
from .cache import TraceRecord
from .compile import Backend, check_backend, check_inductor_options
from .core.engine import Engine, Program
from .core.tracer import Traced
from .cudagraph import CudaGraphRunner, check_cuda_graphs
from .errors import argument_error
from .functional import check_dense_gradients, swap_attributes, tensor_attributes
from .host_memory import ENV_VAR as HOST_MEMORY_ENV
from .host_memory import keep_freed_memory
from .optim import GradientTransformation
from .optim._torch import _check_supported
from .parallel import resolve_strategy
from .parallel.comm import CommStats, comm_stats
from .parallel.strategy import check_same_model, sync_from_rank0
from .precision import resolve_precision
from .remat import POLICIES, RematPolicy, save_matmuls, validate_remat
from .signature import (
    TensorSpec,
    batch_names,
    family_key,
)
from .step_fn import LossFn, StepFunction, TrainState
from .step_signature import StepSignature, describe_batch
from .step_state import LiveState
from .trace import describe_tensor

__all__ = ["Step", "TrainState", "compile_step"]

log = logging.getLogger("functacc")


@dataclass
class _Program(Program):
    """The compiled step for one input signature, and what its outputs mean."""

    changed: list[bool] = field(default_factory=list)  # which state leaves the step rewrites
    names_with_grads: frozenset[str] = frozenset()
    stats: CommStats | None = None


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
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        model = _unwrap(model)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                "loss_fn must be callable as loss_fn(outputs, targets) -> 0-dim tensor, or None "
                f"when the model returns its own loss; got {type(loss_fn).__name__}"
            )
        check_backend(backend)
        keep_host_memory = env_flag(HOST_MEMORY_ENV, True)  # a bad value fails before any work
        if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an int >= 1; got {grad_accum_steps!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None; got {max_grad_norm!r}")
        _check_supported(opt)
        check_dense_gradients(model)
        self.model = model
        self.loss_fn = loss_fn
        self.backend = backend
        self.inductor_options = check_inductor_options(inductor_options, backend)
        self.grad_accum_steps = grad_accum_steps
        self._params: dict[str, Tensor] = dict(model.named_parameters())
        self._buffers: dict[str, Tensor] = dict(model.named_buffers())
        self._last_key: tuple | None = None
        self._last_key_program: _Program | None = None
        self._attributes = tensor_attributes(model)
        self._engine = Engine(
            "the training step",
            backend=backend,
            holder=model,
            inductor_options=self.inductor_options,
            dynamic=dynamic,
            max_traces=max_traces,
        )
        self._cache = self._engine.cache
        self._calls = 0

        link = LiveState.link_for(opt, self._params)
        self._strategy = resolve_strategy(parallel, model, link.groups if link else None)
        self._distributed = self._strategy.topology.world > 1
        if self._distributed:
            # A collective call: every rank builds its step at the same point of its program.
            check_same_model(self._params, "parameter")
            check_same_model(self._buffers, "buffer")
            sync_from_rank0({**self._params, **self._buffers})
        self.precision = resolve_precision(precision)
        self._device = next((t.device for t in self._params.values()), torch.device("cpu"))
        self._signature = StepSignature(model, self._params, self._buffers, self._device.type)
        self._cuda_graphs = check_cuda_graphs(
            cuda_graphs, self._device, dist.get_backend_config() if self._distributed else None
        )
        if not isinstance(cuda_graph_cache_size, int) or cuda_graph_cache_size < 1:
            raise ValueError(
                f"cuda_graph_cache_size must be an int >= 1; got {cuda_graph_cache_size!r}"
            )
        self._cuda_graph_cache_size = cuda_graph_cache_size
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
            validate_remat(model, remat),
        )
        if remat_policy not in POLICIES:
            raise ValueError(
                f"remat_policy must be one of {POLICIES}; got {remat_policy!r}. 'full' "
                "recomputes the whole module in backward (least memory); 'save_matmuls' keeps "
                "the matmul and convolution results and recomputes the rest (less compute); "
                "'selective' keeps those with weights and recomputes attention's (between)."
            )
        if remat_policy != "full" and not remat:
            warnings.warn(
                f"remat_policy={remat_policy!r} has no effect without remat=...: no module "
                "is recomputed. Name the modules to recompute, e.g. remat={'Block'}.",
                stacklevel=3,
            )
        self.remat_policy = remat_policy
        self._state.start(self._fn)
        if keep_host_memory and self._device.type == "cpu":
            # Last, so that a step that fails to build changes nothing in the process.
            keep_freed_memory()

    # -- public ------------------------------------------------------------------------
    @property
    def num_traces(self) -> int:
        """How many times the step has been traced (once per new input signature)."""
        return self._cache.num_traces

    @property
    def traces(self) -> list[TraceRecord]:
        """Every trace so far: why it happened (what changed), which dimensions it made
        symbolic, and its trace and compile time in seconds."""
        return list(self._cache.records)

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
        from tqdm.auto import tqdm

        before = self._cache.num_traces
        bar = tqdm(list(batches), desc="functacc warm-up", unit="batch", disable=not progress)
        for batch in bar:
            args, kwargs = self._as_call(batch)
            self._stateful_program(args, kwargs)
            if self._cache.num_traces > before:
                last = self._cache.records[-1]
                bar.set_postfix_str(f"trace #{last.number}: {last.trace_s + last.compile_s:.1f} s")
        return self._cache.records[before:]

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
        program, tensors = self._program(context, state, args, kwargs, inplace=False, count=count)
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
        """
        program = getattr(self, "_last_program", None)
        comm = program.stats if program is not None and program.stats else CommStats()
        return {
            "strategy": self._strategy.name,
            "world_size": self._strategy.topology.world,
            "collectives": dict(comm.collectives),
            "payload_bytes": dict(comm.payload_bytes),
            "sent_bytes": dict(comm.sent_bytes),
            "memory": {
                "params": _nbytes(self._state.state.params),
                "grads": 0,
                "optimizer": _nbytes(self._state.state.opt_state),
                "buffers": _nbytes(self._state.state.buffers),
            },
        }

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
    def _stateful_program(self, args: tuple, kwargs: dict) -> tuple[_Program, list[Tensor]]:
        """The program for a call of the stateful step (traced and compiled if new)."""
        self._check_call(args, kwargs)
        self._strategy.release_model_params(self._params)  # after sync_model (ZeRO-3)
        self._state.refresh()
        context = ("inplace", self._state_key(self._calls))
        state = self._state.state
        return self._program(context, state, args, kwargs, inplace=True, count=self._calls)

    def _program(
        self,
        context: tuple,
        state: TrainState,
        args: tuple,
        kwargs: dict,
        *,
        inplace: bool,
        count: int,
    ) -> tuple[_Program, list[Tensor]]:
        """The program for this call and its inputs after the state: the model's plain
        tensor attributes (read now, as eager reads them in every forward), then the
        batch's tensors."""
        tensors, batch_key = self._signature.batch(args, kwargs)
        attributes = self._attribute_values()
        if attributes:
            context = (*context, ("tensor attributes", tuple(map(_tensor_key, attributes))))
        key = (batch_key, context)
        if key == self._last_key:  # the common case: compared, not hashed
            return self._last_key_program, [*attributes, *tensors]
        program = self._cache.get(key)
        if program is None:
            # Not compiled for exactly these shapes: a graph with symbolic sizes may take them.
            family = ((("inputs", family_key(tensors)), *batch_key[1:]), context)
            program = self._engine.lookup(key, family, tensors)
            if program is None:
                program, key = self._build(
                    key,
                    family,
                    state,
                    args,
                    kwargs,
                    attributes,
                    tensors,
                    inplace=inplace,
                    count=count,
                )
                attributes = self._attribute_values()  # the trace may have unaliased one
                if inplace and self._cuda_graphs:
                    # Attributes keep their addresses like the state (a new one re-captures).
                    program.run = CudaGraphRunner(
                        program.run,
                        len(self._state.leaves) + len(attributes),
                        cache_size=self._cuda_graph_cache_size,
                    )
        if program.guard is None:
            self._last_key, self._last_key_program = key, program
        return program, [*attributes, *tensors]

    def _unalias_reassigned(self, indices: list[int]) -> None:
        """A tensor attribute that the forward assigns is written back into after every
        call. One that shares memory with a parameter or buffer (``weight_norm`` and
        ``spectral_norm`` start ``module.weight`` as ``weight_orig.data``) gets its own
        copy first, so the write cannot reach the parameter; eager replaces it at the first
        forward anyway."""
        for i in indices:
            _, module, attr = self._attributes[i]
            value = vars(module)[attr]
            model_tensors = (*self._params.values(), *self._buffers.values())
            if any(_shares_storage(value, t) for t in model_tensors):
                vars(module)[attr] = value.clone()

    def _attribute_values(self) -> list[Tensor]:
        values = []
        for name, module, attr in self._attributes:
            value = getattr(module, attr, None)
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"the model's tensor attribute {name!r} is now {type(value).__name__}; the "
                    "step reads it as a tensor input on every call. Keep it a tensor (or "
                    "register it as a buffer) and rebuild the step if the model changed."
                )
            values.append(value)
        return values

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
        if not torch.is_grad_enabled():
            # Eager PyTorch cannot train here either: backward() fails without autograd.
            raise RuntimeError(
                "the training step was called with gradients disabled (inside torch.no_grad() "
                "or torch.inference_mode()); a training step needs autograd, as loss.backward() "
                "does in eager PyTorch. Call it outside that context."
            )
        if self.loss_fn is not None and (len(args) != 2 or kwargs):
            raise TypeError(
                "with a loss_fn the step is called as step(inputs, targets); got "
                f"{len(args)} positional and {len(kwargs)} keyword arguments. Pack several "
                "model inputs into a tuple or dict: step((x1, x2), targets)."
            )

    def _as_call(self, batch: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` for a batch as a training loop passes it to the step."""
        if self.loss_fn is not None:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(
                    "with a loss_fn each warm-up batch is (inputs, targets), as the step is "
                    f"called; got {type(batch).__name__}"
                )
            return tuple(batch), {}
        if isinstance(batch, dict):
            return (), dict(batch)
        if isinstance(batch, (tuple, list)):
            return tuple(batch), {}
        return (batch,), {}

    # -- tracing -----------------------------------------------------------------------
    def _build(
        self,
        key: tuple,
        family: tuple,
        state: TrainState,
        args: tuple,
        kwargs: dict,
        attributes: list[Tensor],
        tensors: list[Tensor],
        *,
        inplace: bool,
        count: int,
    ) -> tuple[_Program, tuple]:
        """Trace and compile the step for this call; returns the program and the key it is
        kept under (see :meth:`StepSignature.left_behind`)."""
        watched = self._signature.model_watch.key()  # the model's part of ``key``
        names = batch_names(args, kwargs, with_targets=self.loss_fn is not None)
        plan = self._engine.plan(key, family, names, tensors, describe_batch(args, kwargs))
        self._engine.check_budget(plan)
        signature = self._strategy.signature(count)
        state_leaves, state_spec = pytree.tree_flatten_with_path(state)
        state_tensors = [t for _, t in state_leaves]
        state_paths = [pytree.keystr(p) for p, _ in state_leaves]
        batch_leaves, batch_spec = pytree.tree_flatten((args, kwargs))
        is_tensor = [isinstance(x, Tensor) for x in batch_leaves]
        constants = [x for x in batch_leaves if not isinstance(x, Tensor)]
        n_state = len(state_tensors)
        n_fixed = n_state + len(attributes)  # inputs before the batch
        meta: dict[str, Any] = {}

        def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
            state_in = pytree.tree_unflatten(list(flat[:n_state]), state_spec)
            tensors, consts = iter(flat[n_fixed:]), iter(constants)
            batch = [next(tensors) if t else next(consts) for t in is_tensor]
            call_args, call_kwargs = pytree.tree_unflatten(batch, batch_spec)
            attribute_inputs = flat[n_state:n_fixed]
            with swap_attributes(self._attributes, attribute_inputs) as reassigned:
                new_state, loss = self._fn(
                    state_in, call_args, call_kwargs, meta=meta, signature=signature
                )
            meta["reassigned"] = sorted(reassigned)
            for i, value in reassigned.items():
                old = attribute_inputs[i]
                if value.shape != old.shape or value.dtype != old.dtype:
                    raise argument_error(
                        f"the forward assigned {describe_tensor(value)} to the model's tensor "
                        f"attribute {self._attributes[i][0]!r}, which holds "
                        f"{describe_tensor(old)}: the step writes a value the forward "
                        "assigns back into the attribute after every call, which needs the "
                        "same shape and dtype. Register it as a buffer of that shape, or keep "
                        "it outside the model."
                    )
            new_leaves, new_spec = pytree.tree_flatten(new_state)
            if new_spec != state_spec:
                raise argument_error(
                    "the optimizer returned a state whose structure differs from the state it "
                    f"was given:\n  given:    {state_spec}\n  returned: {new_spec}\nA "
                    "GradientTransformation's update must return a state shaped like its init."
                )
            old_leaves = flat[:n_state]
            changed = [new is not old for new, old in zip(new_leaves, old_leaves, strict=True)]
            for path, new, old, c in zip(state_paths, new_leaves, old_leaves, changed, strict=True):
                if c and (new.shape != old.shape or new.dtype != old.dtype):
                    raise argument_error(
                        f"the step would change state{path} from {describe_tensor(old)} to "
                        f"{describe_tensor(new)}; the optimizer must keep shapes and dtypes. "
                        "If the model changed dtype after the optimizer state was created "
                        "(model.double(), model.to(torch.bfloat16)), build the optimizer and "
                        "the step after that change: eager torch.optim would keep the old "
                        "state dtype and round through it, which functacc does not reproduce."
                    )
            meta["changed"] = changed
            if inplace:
                # Every write to the state happens here, at the very end of the graph, after
                # all computation that could fail: a step either updates all or nothing.
                for new, old, c in zip(new_leaves, old_leaves, changed, strict=True):
                    if c:
                        old.copy_(new)
                # A tensor attribute the forward assigned holds, after the call, what eager
                # would leave there (written into it: its address stays, as a CUDA graph
                # needs; the next call reads it, as eager's next forward does).
                for i, value in reassigned.items():
                    attribute_inputs[i].copy_(value.detach())
                return (loss,)
            return (loss, *[new for new, c in zip(new_leaves, changed, strict=True) if c])

        example = [*state_tensors, *attributes, *tensors]

        def run_trace() -> Traced:
            return self._engine.trace(flat_step, example, plan, n_fixed=n_fixed)

        traced = run_trace()
        plan.key, plan.family = self._signature.left_behind(
            key, family, watched, traced, run_trace, meta, lambda: self._state_key(count)
        )
        self._unalias_reassigned(meta["reassigned"])
        graph = traced.graph
        if self.remat_policy != "full":
            selective = self.remat_policy == "selective"
            save_matmuls(graph, batch_inputs=len(tensors) if selective else None)
        program = _Program(
            run=self._engine.compile(traced, example),
            graph=graph,
            changed=meta["changed"],
            names_with_grads=meta["names_with_grads"],
            stats=comm_stats(graph) if self._strategy.topology.world > 1 else None,
        )
        self._engine.keep(plan, program, traced, n_fixed=n_fixed)
        return program, plan.key


def _unwrap(model: nn.Module) -> nn.Module:
    """The module to trace: ``torch.compile(model)`` gives its original module (the step
    compiles the whole step itself; the two compute the same function, on the same
    parameters); a data-parallel wrapper is an error, since functacc does that itself."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return _unwrap(model._orig_mod)
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(
            f"model is wrapped in {type(model).__name__}; functacc parallelises the step "
            "itself (data parallel over torchrun's processes by default, or "
            "parallel=functacc.parallel.ZeRO(...)). Pass the module inside: "
            "compile_step(model.module, ...)."
        )
    return model


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _nbytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)
    )


def compile_step(
    model: nn.Module,
    loss_fn: LossFn | None,
    opt: torch.optim.Optimizer | GradientTransformation,
    *,
    backend: Backend = "inductor",
    inductor_options: dict[str, Any] | None = None,
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
) -> Step:
    """Compile the whole training step of ``model`` into one graph.

    Args:
        model: the module to train, already on its device and dtype.
        loss_fn: ``loss_fn(outputs, targets) -> 0-dim tensor`` with
            ``outputs = model(inputs)`` (``inputs`` a tensor, a tuple for ``model(*inputs)``
            or a dict for ``model(**inputs)``); ``None`` if the model returns its own loss
            (a 0-dim tensor, ``.loss`` or ``["loss"]``), then ``step(*args, **kwargs)``.
        opt: a ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` over the model's parameters (all
            param groups and their options honoured; its state and ``param_groups`` stay
            live), or a :class:`functacc.optim.GradientTransformation`.
        backend: ``"inductor"`` (fused kernels) or ``"eager"`` (the traced graph as is).
        inductor_options: ``torch._inductor.config`` settings for this step's compiles,
            as ``torch.compile(options=...)`` takes them, e.g. ``{"cpp_wrapper": True}``;
            they override functacc's defaults (on CPU, a ``post_grad_custom_post_pass``
            of yours replaces functacc's: :mod:`functacc.bias_add` and
            :mod:`functacc.input_checks`).
        grad_accum_steps: split each batch into this many micro-batches inside the graph,
            sum their gradients (of ``loss / k``), update once.
        max_grad_norm: clip the global gradient norm, as ``clip_grad_norm_``.
        parallel: ``None`` (data parallel over all ranks when the world size is > 1),
            :class:`functacc.parallel.DataParallel` or :class:`functacc.parallel.ZeRO`.
        precision: ``None`` (the model's dtype), ``"bf16"``, ``"fp16"`` (with dynamic loss
            scaling) or :class:`functacc.Precision`: autocast compute, float32 master
            weights and optimizer state.
        remat: class names of modules whose activations are recomputed in backward instead
            of stored (e.g. ``{"TransformerEncoderLayer"}``).
        remat_policy: what those modules recompute: ``"full"`` (default) their whole forward,
            as ``torch.utils.checkpoint``; ``"save_matmuls"`` keeps their matmul and
            convolution results from forward and recomputes only the cheap ops in between
            (more memory than ``"full"``, less compute); ``"selective"`` keeps only those
            with a weight operand and recomputes the matmuls of two activations (attention's
            scores and weighted values, whose results grow with the sequence length squared)
            with the softmax and dropout around them, as Megatron-LM's selective
            recomputation.
        cuda_graphs: capture the compiled step as a CUDA graph and replay it; ``None`` means
            on for CUDA models, off elsewhere, and off for a distributed step whose process
            group does not use NCCL for CUDA tensors (a CUDA graph cannot capture gloo's
            collectives; ``True`` is then an error). With symbolic sizes, one capture per
            concrete size.
        dynamic: input sizes traced symbolically. ``None`` (automatic, as torch.compile):
            the first call is static; a later call whose batch differs only in some sizes
            retraces once with those dimensions symbolic, and that graph serves every later
            size (guards checked per call). ``True``: every batch dimension symbolic from
            the first call. ``False``: one static graph per distinct shape (fastest per step;
            use it with a bucketing loader, ``DeviceLoader(..., buckets=...)``).
        max_traces: the most traces the step may take; the one beyond raises
            :class:`functacc.RetraceError` (``None``: no limit). From the third trace on,
            each one logs a warning naming what changed.
        cuda_graph_cache_size: CUDA graphs kept per compiled graph (one per concrete size),
            least recently used evicted; they share one memory pool.

    On CPU (with glibc), building a step makes ``malloc`` keep the memory that steps free
    for the next step instead of returning it to the kernel, as the CUDA caching allocator
    does; the process keeps its high-water mark. ``FUNCTACC_KEEP_HOST_MEMORY=0`` turns this
    off; see :mod:`functacc.host_memory`.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
        ...                             torch.nn.Linear(16, 4))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> step = functacc.compile_step(model, torch.nn.CrossEntropyLoss(), opt,
        ...                              backend="eager")
        >>> loss = step(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    """
    return Step(
        model,
        loss_fn,
        opt,
        backend=backend,
        inductor_options=inductor_options,
        grad_accum_steps=grad_accum_steps,
        max_grad_norm=max_grad_norm,
        parallel=parallel,
        precision=precision,
        remat=remat,
        remat_policy=remat_policy,
        cuda_graphs=cuda_graphs,
        dynamic=dynamic,
        max_traces=max_traces,
        cuda_graph_cache_size=cuda_graph_cache_size,
    )
