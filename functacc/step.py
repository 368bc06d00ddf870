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
import operator
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ._env import env_flag
from .backends import (
    Backend,
    Compiled,
    CudaGraphRunner,
    check_backend,
    check_cuda_graphs,
    check_generators,
    check_inductor_options,
    compile_graph,
    keep_freed_memory,
)
from .backends.host_memory import ENV_VAR as HOST_MEMORY_ENV
from .cache import ProgramCache, SizeGuard, TraceRecord
from .errors import argument_error
from .functional import check_dense_gradients, swap_attributes, tensor_attributes
from .optim import GradientTransformation
from .optim._torch import TorchOptimizerLink, _check_supported
from .parallel import resolve_strategy
from .parallel.comm import CommStats, comm_stats
from .parallel.strategy import check_same_model, sync_from_rank0
from .precision import resolve_precision
from .remat import POLICIES, RematPolicy, save_matmuls, validate_remat
from .signature import (
    AmbientWatch,
    BatchWatch,
    HookWatch,
    ModelWatch,
    StructureWatch,
    TensorSpec,
    batch_names,
    family_key,
    filled_settings,
    hashable_constant,
)
from .step_fn import LossFn, StepFunction, TrainState
from .trace import (
    Traced,
    describe_tensor,
    draws_random,
    rng_state,
    run_error,
    set_rng_state,
    trace,
)

__all__ = ["Step", "TrainState", "compile_step"]

log = logging.getLogger("functacc")


@dataclass
class _Program:
    """One traced and compiled step, for one input signature."""

    run: Compiled
    graph: torch.fx.GraphModule
    changed: list[bool] = field(default_factory=list)  # which state leaves the step rewrites
    names_with_grads: frozenset[str] = frozenset()
    stats: CommStats | None = None
    guard: SizeGuard | None = None  # graphs with symbolic sizes: which sizes they accept
    random: bool = False  # draws random numbers (dropout): a failed run restores the RNG


_tensor_key = TensorSpec.of
_set_grad_enabled = torch._C._set_grad_enabled


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
        named = list(model.named_modules())
        self._modules = [module for _, module in named]
        self._model_tensors = [*self._params.values(), *self._buffers.values()]
        self._model_watch = ModelWatch(
            self._modules,
            self._params,
            self._model_tensors,
            names=[f"model.{name}" if name else "model" for name, _ in named],
        )
        self._hook_watch = HookWatch(model, self._params)
        self._structure = StructureWatch(model)
        self._batch_watch = BatchWatch()
        self._context_parts: tuple | None = None
        self._context_key: tuple = ()
        self._last_key: tuple | None = None
        self._last_key_program: _Program | None = None
        self._attributes = tensor_attributes(model)
        self._cache = ProgramCache("the training step", dynamic=dynamic, max_traces=max_traces)
        self._calls = 0

        self._link = None if isinstance(opt, GradientTransformation) else self._new_link(opt)
        self._strategy = resolve_strategy(
            parallel, model, self._link.groups if self._link else None
        )
        self._distributed = self._strategy.topology.world > 1
        if self._distributed:
            # A collective call: every rank builds its step at the same point of its program.
            check_same_model(self._params, "parameter")
            check_same_model(self._buffers, "buffer")
            sync_from_rank0({**self._params, **self._buffers})
        self.precision = resolve_precision(precision)
        self._device = next((t.device for t in self._params.values()), torch.device("cpu"))
        self._ambient = AmbientWatch(self._device.type)
        self._cuda_graphs = check_cuda_graphs(
            cuda_graphs, self._device, dist.get_backend_config() if self._distributed else None
        )
        if not isinstance(cuda_graph_cache_size, int) or cuda_graph_cache_size < 1:
            raise ValueError(
                f"cuda_graph_cache_size must be an int >= 1; got {cuda_graph_cache_size!r}"
            )
        self._cuda_graph_cache_size = cuda_graph_cache_size
        self._fn = StepFunction(
            model,
            loss_fn,
            self._build_transform(opt),
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
        self._set_live_state(self._initial_state(opt))
        self._installed = False
        if self._link is not None and hasattr(self._strategy, "link_optimizer"):
            # ZeRO: opt.state_dict() gathers the sharded state, load_state_dict() shards it.
            ref = weakref.ref(self)
            self._strategy.link_optimizer(
                self._link,
                lambda: ref()._live if ref() is not None else None,
                lambda: ref()._fn.transform,
            )
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
        scaler = (self._live.extra or {}).get("loss_scale")
        return float(scaler["scale"]) if scaler else None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because their float16 gradients overflowed."""
        scaler = (self._live.extra or {}).get("loss_scale")
        return int(scaler["skipped"]) if scaler else 0

    @property
    def state(self) -> TrainState:
        """The live training state of the stateful form. Its tensors are the ones the step
        updates in place (the model's own parameters, unless sharded)."""
        return self._live

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """One training step that updates the model and the optimizer in place.

        With a ``loss_fn``: ``step(inputs, targets)``; without: ``step(*args, **kwargs)``
        calls ``model(*args, **kwargs)``. Returns the loss, a detached 0-dim tensor.
        """
        program, tensors = self._stateful_program(args, kwargs)
        rng = rng_state([self._device]) if program.random else None
        # The graph writes into tensors that require grad: run it without autograd. Grad
        # mode is on here (checked above); switching it directly costs a tenth of no_grad().
        _set_grad_enabled(False)
        try:
            loss = program.run([*self._live_leaves, *tensors])[0]
        except Exception as exc:
            if rng is not None:  # the graph may have drawn dropout masks before it failed
                set_rng_state(rng)
            raise run_error(exc, self._describe_batch(args, kwargs)) from exc
        finally:
            _set_grad_enabled(True)
        self._calls += 1
        self._last_program = program
        if self._link is not None:
            # What torch.optim.lr_scheduler checks to know the optimizer stepped (it warns
            # about a skipped first value otherwise).
            self._link.optimizer._opt_called = True
        if not self._installed and self._link is not None and self._strategy.named_state:
            # torch creates optimizer state at the first step; so do we, only once the
            # first step has succeeded (a failed first call must leave opt.state empty).
            self._link.install(self._live.opt_state, program.names_with_grads)
            self._installed = True
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
            lambda x: x.detach().clone() if isinstance(x, Tensor) else x, self._live
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
        if self._link is not None:
            state = state._replace(opt_state=self._link.with_current_hyperparams(state.opt_state))
        leaves, spec = pytree.tree_flatten(state)
        state_key = (spec, tuple(_tensor_key(t) for t in leaves))
        count = int(state.count) if self._strategy.signature(0) != () else 0
        context = ("pure", self._state_key(count), ("state", state_key))
        program, tensors = self._program(context, state, args, kwargs, inplace=False, count=count)
        rng = rng_state([self._device]) if program.random else None
        try:
            with torch.no_grad():
                outputs = program.run([*leaves, *tensors])
        except Exception as exc:
            if rng is not None:
                set_rng_state(rng)
            raise run_error(exc, self._describe_batch(args, kwargs)) from exc
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
                "params": _nbytes(self._live.params),
                "grads": 0,
                "optimizer": _nbytes(self._live.opt_state),
                "buffers": _nbytes(self._live.buffers),
            },
        }

    def sync_model(self) -> nn.Module:
        """Make ``model`` hold the full trained parameters on every rank (ZeRO-3 gathers
        them, a collective call; otherwise the model already holds them) and return it.
        Under ZeRO-3 the next step drops these full copies again (the model's parameters
        go back to empty placeholders) without retracing."""
        self._strategy.write_model_params(self._live.params, self._params)
        return self.model

    # -- live state --------------------------------------------------------------------
    def _after_load(self) -> None:
        """After a checkpoint wrote into the live state: the torch optimizer shows it."""
        if self._link is None:
            return
        self._link.write_hyperparams(self._live.opt_state)
        if self._strategy.named_state:
            trainable = {n for n, p in self._params.items() if p.requires_grad}
            self._link.install(self._live.opt_state, trainable)
            self._installed = True

    def _load_full_params(self) -> None:
        """The model's parameters were overwritten (load_model): re-shard them into the
        live state where the state holds shards."""
        self._strategy.load_full_params(self._params, self._live.params)

    def _build_transform(self, opt: Any) -> GradientTransformation:
        if self._link is None:
            return opt
        return self._link.transform(self._strategy.optimizer_groups(self._link.groups))

    def _initial_state(self, opt: Any) -> TrainState:
        strategy = self._strategy
        if self._link is not None and strategy.named_state:
            params = strategy.live_params(self._params)
            opt_state = self._link.read_state(self._params, copy=False)
        elif self._link is not None:
            # Read torch's (full) state before the strategy shards the parameters.
            named = self._link.read_state(self._params, copy=True)
            params = strategy.live_params(self._params)
            opt_params = strategy.optimizer_params(params)
            opt_state = strategy.shard_optimizer_state(named, self._fn.transform, opt_params)
        else:
            params = strategy.live_params(self._params)
            opt_state = self._fn.transform.init(strategy.optimizer_params(params))
        if self._link is not None:
            self._torch_state = opt.state
        # On the parameters' device: a CUDA graph must read and advance it on the GPU.
        count = torch.zeros((), dtype=torch.int64, device=self._device)
        extra = strategy.init_extra(self._params)
        if self.precision is not None and self.precision.loss_scaling:
            extra["loss_scale"] = self.precision.init_state(self._device)
        self._hyper_key = self._link.structure_key() if self._link else ()
        return TrainState(params, self._buffers, opt_state, count, extra)

    def _set_live_state(self, state: TrainState) -> None:
        self._live = state
        self._live_leaves, self._live_spec = pytree.tree_flatten(state)

    def _refresh_live_state(self) -> None:
        """Follow ``opt.load_state_dict`` and hyperparameter edits made between calls."""
        if self._link is None:
            return
        if self._link.optimizer.state is not self._torch_state and self._strategy.named_state:
            # load_state_dict() replaces the state dict: adopt its tensors as the live state.
            self._torch_state = self._link.optimizer.state
            opt_state = self._link.read_state(self._params, copy=False)
            self._set_live_state(self._live._replace(opt_state=opt_state))
            self._installed = False
        if not self._link.poll():
            return  # param_groups as at the last call: nothing to re-read
        if not self._link.same_groups():
            try:
                self._regroup()
            except Exception:
                self._link.forget_poll()  # the next call checks (and fails) again
                raise
        hyper_key = self._link.structure_key()
        if hyper_key != self._hyper_key:
            self._fn.transform = self._build_transform(self._link.optimizer)
            self._hyper_key = hyper_key
        self._link.sync_hyperparams(self._live.opt_state)

    def _regroup(self) -> None:
        """``optimizer.add_param_group()`` (or a group's parameters edited) after the step
        was built: as in eager, the new parameters train from this call on. The optimizer
        state of the parameters already trained carries over (it is the torch optimizer's
        own); the new ones start fresh, and the next trace updates every group."""
        optimizer = self._link.optimizer
        if not self._strategy.named_state:
            raise RuntimeError(
                f"optimizer.param_groups changed after the {self._strategy.name} step was "
                "built (optimizer.add_param_group(), or parameters added to or removed from a "
                "group): the step shards each group's parameters when it is built. Build the "
                "step again with compile_step() after changing the optimizer's groups."
            )
        link = self._new_link(optimizer)
        opt_state = link.read_state(self._params, copy=False)  # checks before any change
        self._link = link
        self._fn.transform = self._build_transform(optimizer)
        self._set_live_state(self._live._replace(opt_state=opt_state))
        self._installed = False  # the new parameters' state goes into opt.state next step
        self._hyper_key = link.structure_key()  # a new structure: the next trace

    def _new_link(self, optimizer: torch.optim.Optimizer) -> TorchOptimizerLink:
        return TorchOptimizerLink(optimizer, {id(p): n for n, p in self._params.items()})

    def _state_key(self, count: int) -> tuple:
        # Per-call checks of what changes the graph: train/eval mode, which parameters are
        # trainable, the dtypes of the model's tensors, the optimizer structure, the
        # strategy's phase and the ambient state a trace bakes in (autocast, default dtype).
        # Each watch returns the same object while its part is unchanged, so the common call
        # compares a few identities and reuses the last key. Sizes and strides of the graph's
        # inputs are not re-read here: the compiled graph asserts them on every call
        # (Inductor's wrapper; the eager backend's ops reject other sizes), and the live
        # state keeps them.
        parts = (
            self._model_watch.key(),
            self._hyper_key,
            self._strategy.signature(count),
            self._ambient.key(),
            self._hook_watch.key(),
        )
        if parts != self._context_parts:
            if self._context_parts is None or parts[0] is not self._context_parts[0]:
                # The model's tensors changed dtype, device or requires_grad: model.double()
                # and model.to() also replace its buffers, which no hook reports.
                self._structure.rescan()
                self._check_structure()
                check_dense_gradients(self.model)  # a sparse embedding unfrozen
            model, hyper, parallel, ambient, hooks = parts
            self._context_parts = parts
            self._context_key = (
                *model,
                ("optimizer hyperparameters", hyper),
                ("parallel", parallel),
                ("ambient", ambient),
                ("hooks", hooks),
            )
        return self._context_key

    # -- programs ----------------------------------------------------------------------
    def _stateful_program(self, args: tuple, kwargs: dict) -> tuple[_Program, list[Tensor]]:
        """The program for a call of the stateful step (traced and compiled if new)."""
        self._check_call(args, kwargs)
        self._strategy.release_model_params(self._params)  # after sync_model (ZeRO-3)
        self._refresh_live_state()
        context = ("inplace", self._state_key(self._calls))
        return self._program(context, self._live, args, kwargs, inplace=True, count=self._calls)

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
        tensors, batch_key = self._flatten_batch(args, kwargs)
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
            program = self._cache.find(family, tensors)
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
                        len(self._live_leaves) + len(attributes),
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
            if any(_shares_storage(value, t) for t in self._model_tensors):
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
        self._check_structure()
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

    def _check_structure(self) -> None:
        if self._structure.replaced is not None:
            raise RuntimeError(
                f"model.{self._structure.replaced} was replaced or added after compile_step "
                "built this step. The step trains the tensors and modules it was built "
                "with, so it would keep updating the old ones while the model uses the new "
                "(eager PyTorch would use the new). Change values in place instead (e.g. "
                "module.running_mean.copy_(new), model.load_state_dict(...)), or build a new "
                "step with compile_step(...) after changing the model (model.double() and "
                "model.to(device) replace its buffers)."
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

    def _flatten_batch(self, args: tuple, kwargs: dict) -> tuple[list[Tensor], tuple]:
        """The batch's tensors and its signature key (its first part: the tensor specs)."""
        if not kwargs and all(type(a) is Tensor for a in args):
            # The common step(inputs, targets): no pytree walk on the hot path.
            return list(args), (("inputs", self._batch_watch.key(args)),)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        constants = [x for x in leaves if not isinstance(x, Tensor)]
        key = (
            ("inputs", tuple(_tensor_key(t) for t in tensors)),
            ("structure", str(spec)),
            ("constants", tuple(map(hashable_constant, constants))),
        )
        return tensors, key

    def _describe_batch(self, args: tuple, kwargs: dict) -> str:
        items = pytree.tree_flatten_with_path((args, kwargs))[0]
        parts = []
        for path, leaf in items:
            name = "args" + pytree.keystr(path[1:]) if path[0].idx == 0 else pytree.keystr(path[1:])
            if isinstance(leaf, Tensor):
                parts.append(f"{name}: {describe_tensor(leaf)}")
            else:
                parts.append(f"{name}: {leaf!r}")
        return "; ".join(parts) or "no inputs"

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
        kept under (see :meth:`_key_left_behind`)."""
        watched = self._model_watch.key()  # the model's part of ``key``
        names = batch_names(args, kwargs, with_targets=self.loss_fn is not None)
        described = self._describe_batch(args, kwargs)
        reason = self._cache.reason(key, family, names, tensors)
        self._cache.check_budget(reason, described)
        dynamic = self._cache.plan(family, tensors)
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
            return trace(
                flat_step,
                example,
                model=self.model,
                signature=described,
                dynamic=[*[()] * n_fixed, *dynamic] if any(dynamic) else None,
            )

        started = time.perf_counter()
        traced = run_trace()
        key, family = self._key_left_behind(key, family, count, watched, traced, run_trace, meta)
        traced_at = time.perf_counter()
        self._unalias_reassigned(meta["reassigned"])
        graph = traced.graph
        if self.remat_policy != "full":
            selective = self.remat_policy == "selective"
            save_matmuls(graph, batch_inputs=len(tensors) if selective else None)
        check_generators(graph, self.backend, self.model)
        run = compile_graph(
            graph, example, self.backend, fakes=traced.fakes, options=self.inductor_options
        )
        guard = None
        symbolic: dict[str, list[int]] = {}
        if traced.fakes is not None:
            guard = SizeGuard(traced.fakes[n_fixed:], dynamic, traced.guard)
            fixed = {(i, d) for i, d, _ in guard.static}
            for i, dims in enumerate(dynamic):
                kept = sorted(d for d in dims if (i, d) not in fixed)
                if kept:
                    symbolic[names[i]] = kept
        program = _Program(
            run=run,
            graph=graph,
            changed=meta["changed"],
            names_with_grads=meta["names_with_grads"],
            stats=comm_stats(graph) if self._strategy.topology.world > 1 else None,
            guard=guard,
            random=draws_random(graph),
        )
        record = TraceRecord(
            number=self._cache.num_traces + 1,
            reason=reason,
            signature=described,
            dynamic=symbolic,
            trace_s=traced_at - started,
            compile_s=time.perf_counter() - traced_at,
        )
        self._cache.add(key, family, program, names=names, tensors=tensors, record=record)
        return program, key

    def _key_left_behind(
        self,
        key: tuple,
        family: tuple,
        count: int,
        watched: tuple,
        traced: Traced,
        run_trace: Callable[[], Traced],
        meta: dict[str, Any],
    ) -> tuple[tuple, tuple]:
        """The key and family to keep a new program under: the call's own, or the
        signature the forward left behind where the trace filled in settings that were
        ``None`` or absent (Hugging Face classifiers set ``config.problem_type`` at their
        first forward, and never again). The next call has that signature; keyed on the
        call's own, it would be traced and compiled again for an identical graph.

        Only if the forward takes the same path with the new values: a forward that read
        the setting before filling it in holds another graph from its second call on (as
        eager reads the new value), and one that changes it on every call has no stable
        signature. A second trace (fake tensors, not compiled) with the new values shows
        both; the model's settings are then put back to what one forward left, as in eager.
        """
        left = self._model_watch.key()
        if left is watched or not filled_settings(watched, left):
            return key, family
        restore = self._model_watch.snapshot()
        first = dict(meta)
        try:
            again = run_trace()
            same = self._model_watch.key() == left and _same_graph(traced, again)
        except Exception:  # refused or failed with the new values: keep the call's key
            same = False
        finally:
            restore()
            meta.clear()
            meta.update(first)
        if not same:
            return key, family
        log.info(
            "functacc: the forward filled in %s while tracing, and takes the same path with "
            "the new values: the graph is kept for the signature it leaves behind",
            ", ".join(filled_settings(watched, left) or ()),
        )
        batch_key, context = key
        context = (context[0], self._state_key(count), *context[2:])
        return (batch_key, context), (family[0], context)


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


def _same_graph(a: Traced, b: Traced) -> bool:
    """Two traces of the step recorded the same computation: the same code, the same
    constants (a Python value turned into a tensor, ``torch.tensor(scale)``) and, with
    symbolic sizes, the same guard."""
    return a.guard == b.guard and _same_code(a.graph, b.graph)


def _same_code(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    if a.code != b.code:
        return False
    for node in a.graph.nodes:
        if node.op != "get_attr":
            continue
        get = operator.attrgetter(node.target)  # a dotted name for a nested attribute
        x, y = get(a), get(b)
        if isinstance(x, torch.fx.GraphModule) and isinstance(y, torch.fx.GraphModule):
            if not _same_code(x, y):  # a higher-order op's body (remat's checkpoint)
                return False
        elif isinstance(x, Tensor) and isinstance(y, Tensor):
            if x is not y and (x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y)):
                return False
        elif x is not y and type(x) is type(y) and not isinstance(x, nn.Module) and x == y:
            continue
        elif x is not y:
            return False
    return True


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
