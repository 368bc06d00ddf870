"""``compile_step``: the whole training step as one traced, compiled pure function.

One call of the step is: forward, loss, backward (``torch.autograd.grad`` traced into the
same graph, the joint-graph approach of AOTAutograd), gradient clipping, the optimizer update
and the new BatchNorm statistics. It is traced once per input signature with fake tensors,
compiled, and then replayed.

Two forms share the same mathematics:

- ``step(inputs, targets)`` updates the model's own tensors and the ``torch.optim``
  optimizer's own state in place (the graph writes into them), so the rest of a PyTorch
  program (saving, evaluation, export, ``opt.state_dict()``) keeps working;
- ``step.apply(state, inputs, targets) -> (new_state, loss)`` is pure: it mutates nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .compile import (
    Backend,
    Compiled,
    SignatureCache,
    TensorSpec,
    check_backend,
    compile_graph,
)
from .errors import argument_error
from .functional import call_module
from .optim import GradientTransformation, clip_by_global_norm
from .optim._torch import TorchOptimizerLink, _check_supported
from .optim._transform import step_params
from .trace import describe_tensor, run_error, trace

__all__ = ["Step", "TrainState", "compile_step"]

log = logging.getLogger("functacc")

LossFn = Callable[[Any, Any], Tensor]


class TrainState(NamedTuple):
    """Everything a training step reads and writes.

    ``params`` and ``buffers`` are keyed like ``model.named_parameters()`` /
    ``named_buffers()``; ``opt_state`` is the optimizer's pure state; ``count`` is the number
    of steps taken (0-dim int64 tensor).
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: Any
    count: Tensor


@dataclass
class _Program:
    """One traced and compiled step, for one input signature."""

    run: Compiled
    graph: torch.fx.GraphModule
    constants: list[Any]  # non-tensor leaves of the batch, baked into the graph
    changed: list[bool] = field(default_factory=list)  # which state leaves the step rewrites
    names_with_grads: frozenset[str] = frozenset()


_tensor_key = TensorSpec.of


def _leaf_name(path: tuple) -> str:
    return pytree.keystr(path)


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
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                "loss_fn must be callable as loss_fn(outputs, targets) -> 0-dim tensor, or None "
                f"when the model returns its own loss; got {type(loss_fn).__name__}"
            )
        check_backend(backend)
        if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an int >= 1; got {grad_accum_steps!r}")
        self.model = model
        self.loss_fn = loss_fn
        self.backend = backend
        self.grad_accum_steps = grad_accum_steps
        self._clip = clip_by_global_norm(max_grad_norm) if max_grad_norm is not None else None
        self._params: dict[str, Tensor] = dict(model.named_parameters())
        self._buffers: dict[str, Tensor] = dict(model.named_buffers())
        self._modules = list(model.modules())
        self._cache = SignatureCache("the training step")

        _check_supported(opt)
        if isinstance(opt, GradientTransformation):
            self._link: TorchOptimizerLink | None = None
            self._transform = opt
            opt_state = opt.init({n: p.detach() for n, p in self._params.items()})
        else:
            names = {id(p): n for n, p in self._params.items()}
            self._link = TorchOptimizerLink(opt, names)
            self._transform = self._link.transform()
            opt_state = self._link.read_state(self._params, copy=False)
            self._torch_state = opt.state
        self._hyper_key = self._link.structure_key() if self._link else ()
        count = torch.zeros((), dtype=torch.int64)
        self._set_live_state(TrainState(self._params, self._buffers, opt_state, count))
        self._installed = False

    # -- public ------------------------------------------------------------------------
    @property
    def num_traces(self) -> int:
        """How many times the step has been traced (once per new input signature)."""
        return self._cache.num_traces

    @property
    def count(self) -> int:
        """Steps taken by the stateful form."""
        return int(self._live.count)

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """One training step that updates the model and the optimizer in place.

        With a ``loss_fn``: ``step(inputs, targets)``; without: ``step(*args, **kwargs)``
        calls ``model(*args, **kwargs)``. Returns the loss, a detached 0-dim tensor.
        """
        self._check_call(args, kwargs)
        self._refresh_live_state()
        if self._link is not None:
            self._link.sync_hyperparams(self._live.opt_state)
        tensors, batch_key = self._flatten_batch(args, kwargs)
        key = ("inplace", batch_key, self._state_key())
        program = self._cache.get(key)
        if program is None:
            program = self._build(key, self._live, args, kwargs, inplace=True)
        try:
            with torch.no_grad():
                loss = program.run([*self._live_leaves, *tensors])[0]
        except Exception as exc:
            raise run_error(exc, self._describe_batch(args, kwargs)) from exc
        if not self._installed and self._link is not None:
            # torch creates optimizer state at the first step; so do we, only once the
            # first step has succeeded (a failed first call must leave opt.state empty).
            self._link.install(self._live.opt_state, program.names_with_grads)
            self._installed = True
        return loss

    def init_state(self) -> TrainState:
        """A copy of the current training state (model, optimizer, step count) for
        :meth:`apply`. Later calls of the stateful step do not change it."""
        params = {n: p.detach().clone() for n, p in self._params.items()}
        buffers = {n: b.detach().clone() for n, b in self._buffers.items()}
        if self._link is not None:
            opt_state = self._link.read_state(params, copy=True)
        else:
            opt_state = pytree.tree_map(
                lambda x: x.clone() if isinstance(x, Tensor) else x, self._live.opt_state
            )
        return TrainState(params, buffers, opt_state, self._live.count.clone())

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
        if self._link is not None:
            state = state._replace(opt_state=self._link.with_current_hyperparams(state.opt_state))
        leaves, spec = pytree.tree_flatten(state)
        tensors, batch_key = self._flatten_batch(args, kwargs)
        state_key = (spec, tuple(_tensor_key(t) for t in leaves))
        key = ("pure", batch_key, self._state_key(), ("state", state_key))
        program = self._cache.get(key)
        if program is None:
            program = self._build(key, state, args, kwargs, inplace=False)
        try:
            with torch.no_grad():
                outputs = program.run([*leaves, *tensors])
        except Exception as exc:
            raise run_error(exc, self._describe_batch(args, kwargs)) from exc
        new = iter(outputs[1:])
        new_leaves = [next(new) if c else t for t, c in zip(leaves, program.changed, strict=True)]
        return pytree.tree_unflatten(new_leaves, spec), outputs[0]

    # -- live state --------------------------------------------------------------------
    def _set_live_state(self, state: TrainState) -> None:
        self._live = state
        self._live_leaves, self._live_spec = pytree.tree_flatten(state)

    def _refresh_live_state(self) -> None:
        """Follow ``opt.load_state_dict`` and hyperparameter edits made between calls."""
        if self._link is None:
            return
        if self._link.optimizer.state is not self._torch_state:
            # load_state_dict() replaces the state dict: adopt its tensors as the live state.
            self._torch_state = self._link.optimizer.state
            opt_state = self._link.read_state(self._params, copy=False)
            self._set_live_state(self._live._replace(opt_state=opt_state))
            self._installed = False
        hyper_key = self._link.structure_key()
        if hyper_key != self._hyper_key:
            self._transform = self._link.transform()
            self._hyper_key = hyper_key

    def _state_key(self) -> tuple:
        # Cheap per-call checks of what changes the graph: train/eval mode, which parameters
        # are trainable, dtypes/shapes of the model's tensors, optimizer hyperparameters.
        return (
            ("train mode", tuple(m.training for m in self._modules)),
            ("requires_grad", tuple(p.requires_grad for p in self._params.values())),
            ("model tensors", tuple((p.dtype, p.shape) for p in self._live_leaves_model())),
            ("optimizer hyperparameters", self._hyper_key),
        )

    def _live_leaves_model(self):
        yield from self._params.values()
        yield from self._buffers.values()

    # -- batches -----------------------------------------------------------------------
    def _check_call(self, args: tuple, kwargs: dict) -> None:
        if self.loss_fn is not None and (len(args) != 2 or kwargs):
            raise TypeError(
                "with a loss_fn the step is called as step(inputs, targets); got "
                f"{len(args)} positional and {len(kwargs)} keyword arguments. Pack several "
                "model inputs into a tuple or dict: step((x1, x2), targets)."
            )

    def _flatten_batch(self, args: tuple, kwargs: dict) -> tuple[list[Tensor], tuple]:
        """The batch's tensors and its signature key."""
        if not kwargs and all(type(a) is Tensor for a in args):
            # The common step(inputs, targets): no pytree walk on the hot path.
            return list(args), (("inputs", tuple(map(_tensor_key, args))),)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        constants = [x for x in leaves if not isinstance(x, Tensor)]
        key = (
            ("inputs", tuple(_tensor_key(t) for t in tensors)),
            ("structure", str(spec)),
            ("constants", tuple(map(_hashable_constant, constants))),
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

    def _split(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        k = self.grad_accum_steps
        if k == 1:
            return [(args, kwargs)]
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] % k:
                raise argument_error(
                    f"grad_accum_steps={k} splits every batch tensor into {k} micro-batches "
                    f"along dim 0, but batch{_leaf_name(path)} has {leaf.shape[0]} rows. Use a "
                    f"batch size divisible by {k} (e.g. DataLoader(..., drop_last=True))."
                )
        micro = []
        for i in range(k):
            chunk = [
                x.tensor_split(k)[i] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves
            ]
            micro.append(pytree.tree_unflatten(chunk, spec))
        return micro

    # -- the step function -------------------------------------------------------------
    def _loss(self, outputs: Any, args: tuple) -> Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(outputs, args[1])
            what = "loss_fn(outputs, targets)"
        else:
            loss = _model_loss(outputs)
            what = "the model's loss"
        if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            got = describe_tensor(loss) if isinstance(loss, Tensor) else type(loss).__name__
            raise argument_error(
                f"{what} must be a 0-dim floating-point tensor (the value to minimise); got "
                f"{got}. Reduce it to a scalar, e.g. with reduction='mean' or loss.mean()."
            )
        return loss

    def _call_model(
        self, params: dict, buffers: dict, args: tuple, kwargs: dict
    ) -> tuple[Any, dict]:
        if self.loss_fn is not None:
            inputs = args[0]
            if isinstance(inputs, Mapping):
                args, kwargs = (), dict(inputs)
            elif isinstance(inputs, (tuple, list)):
                args, kwargs = tuple(inputs), {}
            else:
                args, kwargs = (inputs,), {}
        return call_module(self.model, params, buffers, args, kwargs)

    def _step_fn(
        self, state: TrainState, args: tuple, kwargs: dict, *, meta: dict
    ) -> tuple[TrainState, Tensor]:
        params = state.params
        trainable = [n for n, p in self._params.items() if p.requires_grad]
        buffers = state.buffers
        grads: list[Tensor | None] = [None] * len(trainable)
        losses = []
        micro_batches = self._split(args, kwargs)
        for micro_args, micro_kwargs in micro_batches:
            with torch.enable_grad():
                leaves = {n: params[n].detach().requires_grad_() for n in trainable}
                outputs, buffers = self._call_model(
                    {**params, **leaves}, buffers, micro_args, micro_kwargs
                )
                loss = self._loss(outputs, micro_args)
                # The eager reference for accumulation is (loss / k).backward() per micro-batch.
                scaled = loss / len(micro_batches) if len(micro_batches) > 1 else loss
                if scaled.requires_grad and leaves:
                    micro_grads = torch.autograd.grad(
                        scaled, list(leaves.values()), allow_unused=True
                    )
                else:
                    micro_grads = (None,) * len(trainable)
            grads = [
                g if acc is None else (acc if g is None else acc + g)
                for acc, g in zip(grads, micro_grads, strict=True)
            ]
            losses.append(loss.detach())
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        named_grads = {n: g for n, g in zip(trainable, grads, strict=True) if g is not None}
        meta["names_with_grads"] = frozenset(named_grads)
        if self._clip is not None:
            named_grads, _ = self._clip.update(named_grads, (), params)
        new_params, opt_state = step_params(self._transform, named_grads, state.opt_state, params)
        return TrainState(new_params, buffers, opt_state, state.count + 1), loss

    def _build(
        self, key: tuple, state: TrainState, args: tuple, kwargs: dict, *, inplace: bool
    ) -> _Program:
        reason = self._cache.reason(key)
        state_leaves, state_spec = pytree.tree_flatten_with_path(state)
        state_tensors = [t for _, t in state_leaves]
        state_paths = [_leaf_name(p) for p, _ in state_leaves]
        batch_leaves, batch_spec = pytree.tree_flatten((args, kwargs))
        is_tensor = [isinstance(x, Tensor) for x in batch_leaves]
        constants = [x for x in batch_leaves if not isinstance(x, Tensor)]
        n_state = len(state_tensors)
        meta: dict[str, Any] = {}

        def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
            state_in = pytree.tree_unflatten(list(flat[:n_state]), state_spec)
            tensors, consts = iter(flat[n_state:]), iter(constants)
            batch = [next(tensors) if t else next(consts) for t in is_tensor]
            call_args, call_kwargs = pytree.tree_unflatten(batch, batch_spec)
            new_state, loss = self._step_fn(state_in, call_args, call_kwargs, meta=meta)
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
                        f"{describe_tensor(new)}; the optimizer must keep shapes and dtypes"
                    )
            meta["changed"] = changed
            if inplace:
                # Every write to the state happens here, at the very end of the graph, after
                # all computation that could fail: a step either updates all or nothing.
                for new, old, c in zip(new_leaves, old_leaves, changed, strict=True):
                    if c:
                        old.copy_(new)
                return (loss,)
            return (loss, *[new for new, c in zip(new_leaves, changed, strict=True) if c])

        example = [*state_tensors, *[x for x in batch_leaves if isinstance(x, Tensor)]]
        graph = trace(
            flat_step, example, model=self.model, signature=self._describe_batch(args, kwargs)
        )
        run = compile_graph(graph, example, self.backend)
        program = _Program(
            run=run,
            graph=graph,
            constants=constants,
            changed=meta["changed"],
            names_with_grads=meta["names_with_grads"],
        )
        self._cache.put(key, program, reason=reason)
        return program


def _hashable_constant(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return (type(x), x)


def _model_loss(outputs: Any) -> Any:
    """The loss a model computed itself: a tensor, ``outputs["loss"]`` or ``outputs.loss``."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping) and "loss" in outputs:
        return outputs["loss"]
    if hasattr(outputs, "loss"):
        return outputs.loss
    raise argument_error(
        "with loss_fn=None the model must compute its own loss: return a 0-dim tensor, an "
        f"object with a .loss attribute, or a mapping with key 'loss'; got "
        f"{type(outputs).__name__}. Pass loss_fn=... to compute the loss from the outputs."
    )


def compile_step(
    model: nn.Module,
    loss_fn: LossFn | None,
    opt: torch.optim.Optimizer | GradientTransformation,
    *,
    backend: Backend = "inductor",
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
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
        grad_accum_steps: split each batch into this many micro-batches inside the graph,
            sum their gradients (of ``loss / k``), update once.
        max_grad_norm: clip the global gradient norm, as ``clip_grad_norm_``.

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
        grad_accum_steps=grad_accum_steps,
        max_grad_norm=max_grad_norm,
    )
