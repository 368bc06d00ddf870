"""The pure training step: ``(state, batch) -> (new_state, loss)``.

Forward, loss, ``torch.autograd.grad`` (traced into the same graph: the joint-graph approach
of AOTAutograd, which keeps eager's kernels, dropout's included), gradient accumulation,
the gradient collectives of the parallel strategy, clipping and the optimizer update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..backends import mark_optimizer_inputs
from ..core.diagnostics import describe_tensor
from ..core.functional import call_module, swap_attributes, unwrap
from ..core.torch_checkpoint import no_checkpoint_draws
from ..errors import argument_error
from ..optim import GradientTransformation
from ..optim._transform import step_params
from ..parallel.strategy import Strategy
from ..transforms.precision import Precision
from ..transforms.remat import rematerialize

__all__ = ["LossFn", "StepFunction", "TrainState", "flat_form"]

LossFn = Callable[[Any, Any], Tensor]


class TrainState(NamedTuple):
    """Everything a training step reads and writes.

    ``params`` and ``buffers`` are keyed like ``model.named_parameters()`` /
    ``named_buffers()`` (under ZeRO-3 the sharded parameters are flat shards keyed by their
    wrap unit); ``opt_state`` is the optimizer's pure state; ``count`` is the number of steps
    taken (0-dim int64 tensor); ``extra`` holds the state of step transforms such as
    PowerSGD's error feedback.
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: Any
    count: Tensor
    extra: dict[str, Any] | None = None


@dataclass
class StepFunction:
    """The pure step of one model, loss, optimizer and parallel strategy."""

    model: nn.Module
    loss_fn: LossFn | None
    transform: GradientTransformation
    strategy: Strategy
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    precision: Precision | None = None
    remat: frozenset[str] = frozenset()

    def __call__(
        self, state: TrainState, args: tuple, kwargs: dict, *, meta: dict, signature: tuple = ()
    ) -> tuple[TrainState, Tensor]:
        strategy = self.strategy
        params = state.params
        originals = dict(self.model.named_parameters())
        trainable = {n for n, p in originals.items() if p.requires_grad}
        names = strategy.differentiable(params, trainable)
        hooks = gradient_hooks(originals, names)
        buffers = state.buffers
        extra = dict(state.extra or {})
        scaler = extra.get("loss_scale")
        device_type = next(iter(params.values())).device.type if params else "cpu"
        grads: list[Tensor | None] = [None] * len(names)
        losses = []
        micro_batches = split_micro_batches(args, kwargs, self.grad_accum_steps)
        for micro_args, micro_kwargs in micro_batches:
            with torch.enable_grad():
                leaves = {n: params[n].detach().requires_grad_() for n in names}
                for name, name_hooks in hooks.items():
                    for hook in name_hooks:
                        leaves[name].register_hook(hook)
                with (
                    strategy.materialize({**params, **leaves}, self.model) as model_params,
                    rematerialize(self.model, self.remat),
                ):
                    with self._autocast(device_type):
                        outputs, buffers = self._call_model(
                            model_params, buffers, micro_args, micro_kwargs
                        )
                        loss = self._loss(outputs, micro_args)
                    # The eager reference for accumulation is (loss / k).backward() per
                    # micro-batch.
                    scaled = loss / len(micro_batches) if len(micro_batches) > 1 else loss
                    if scaler:
                        scaled = scaled * scaler["scale"].to(scaled.dtype)
                    if not scaled.requires_grad:
                        raise no_gradient_error()
                    if leaves:
                        with no_checkpoint_draws():
                            micro_grads = torch.autograd.grad(
                                scaled, list(leaves.values()), allow_unused=True
                            )
                    else:
                        micro_grads = (None,) * len(names)
            grads = [
                g if acc is None else (acc if g is None else acc + g)
                for acc, g in zip(grads, micro_grads, strict=True)
            ]
            losses.append(loss.detach().float() if loss.dtype != torch.float64 else loss.detach())
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        named_grads = {n: g for n, g in zip(names, grads, strict=True) if g is not None}
        meta["names_with_grads"] = frozenset(named_grads)
        named_grads, extra = strategy.reduce_gradients(named_grads, extra, signature)
        buffers = strategy.sync_buffers(buffers)
        found_inf = None
        if scaler and named_grads:
            named_grads, found_inf = self.precision.unscale(named_grads, scaler)
            found_inf = strategy.any_rank(found_inf)
        if self.max_grad_norm is not None and named_grads:
            # torch.nn.utils.clip_grad_norm_'s formula, with no data-dependent branch.
            norm = strategy.global_norm(named_grads)
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            named_grads = {n: g.mul(coef.to(g.device)) for n, g in named_grads.items()}
        # Where the update starts: Inductor compiles it as a graph of its own, the same for
        # every batch shape (functacc.split).
        marked = mark_optimizer_inputs(
            [*named_grads.values(), *([found_inf] if found_inf is not None else [])]
        )
        named_grads = dict(zip(named_grads, marked[: len(named_grads)], strict=True))
        if found_inf is not None:
            found_inf = marked[-1]
        opt_params = strategy.optimizer_params(params)
        updated, opt_state = step_params(self.transform, named_grads, state.opt_state, opt_params)
        updated = {n: updated[n] for n in named_grads if n in updated}
        new_params = strategy.new_params(updated, params)
        if found_inf is not None:
            # An overflowing step is skipped: every parameter and optimizer tensor keeps its
            # exact bits (selected, not recomputed), decided on the device, no host sync.
            new_params = _keep_if(found_inf, params, new_params)
            opt_state = pytree.tree_map(
                lambda old, new: torch.where(found_inf, old, new) if new is not old else old,
                state.opt_state,
                opt_state,
            )
            extra["loss_scale"] = self.precision.next_state(scaler, found_inf)
        return TrainState(new_params, buffers, opt_state, state.count + 1, extra), loss

    def _autocast(self, device_type: str) -> Any:
        if self.precision is None:
            return contextlib.nullcontext()
        return self.precision.autocast(device_type)

    def _call_model(
        self, params: dict, buffers: Mapping[str, Tensor], args: tuple, kwargs: dict
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

    def _loss(self, outputs: Any, args: tuple) -> Tensor:
        if self.loss_fn is not None:
            return checked_loss(self.loss_fn(outputs, args[1]), "loss_fn(outputs, targets)")
        return checked_loss(model_loss(outputs), "the model's loss")


def check_step_arguments(
    model: Any, loss_fn: Any, grad_accum_steps: Any, max_grad_norm: Any
) -> nn.Module:
    """The model (unwrapped from DDP or torch.compile), after checking ``compile_step``'s
    arguments that every pipeline takes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            "loss_fn must be callable as loss_fn(outputs, targets) -> 0-dim tensor, or None "
            f"when the model returns its own loss; got {type(loss_fn).__name__}"
        )
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an int >= 1; got {grad_accum_steps!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None; got {max_grad_norm!r}")
    return unwrap(model)


def check_grad_enabled() -> None:
    """A training step called under ``torch.no_grad()`` or ``inference_mode()`` is an error:
    eager PyTorch cannot train there either (``backward()`` fails without autograd)."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "the training step was called with gradients disabled (inside torch.no_grad() "
            "or torch.inference_mode()); a training step needs autograd, as loss.backward() "
            "does in eager PyTorch. Call it outside that context."
        )


def checked_loss(loss: Any, what: str) -> Tensor:
    """``loss`` if it is a 0-dim floating-point tensor, else a clear error."""
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = describe_tensor(loss) if isinstance(loss, Tensor) else type(loss).__name__
        raise argument_error(
            f"{what} must be a 0-dim floating-point tensor (the value to minimise); got "
            f"{got}. Reduce it to a scalar, e.g. with reduction='mean' or loss.mean()."
        )
    return loss


def no_gradient_error() -> Exception:
    """A loss that needs no gradient. Eager: ``loss.backward()`` fails ("element 0 of
    tensors does not require grad and does not have a grad_fn"); training on would
    silently change nothing."""
    return argument_error(
        "the loss does not depend on any trainable parameter, so there is nothing to "
        "differentiate (eager PyTorch's loss.backward() fails here too: 'element 0 of "
        "tensors does not require grad'). Is the model's output detached (.detach(), "
        ".item(), torch.no_grad() in forward), or are all parameters frozen "
        "(requires_grad=False)?"
    )


def gradient_hooks(originals: Mapping[str, Tensor], names: list[str]) -> dict[str, list]:
    """The ``p.register_hook`` hooks of the model's parameters, by name. The step puts
    them on the tensors it takes gradients of, where ``torch.autograd.grad`` runs them as
    ``backward()`` does: on the parameter's gradient of each micro-batch, before it is
    accumulated, reduced over ranks or clipped. Hooks functacc cannot run as eager does
    are an error, not left out."""
    hooks = {}
    for name, p in originals.items():
        if p._post_accumulate_grad_hooks:
            raise argument_error(
                f"parameter {name!r} has a post-accumulate-grad hook "
                "(register_post_accumulate_grad_hook). The compiled step never writes .grad "
                "(the gradients go straight into the optimizer update inside the graph), so "
                "the hook would not run. Remove it (handle.remove()), or move what it does "
                "into a GradientTransformation."
            )
        if p._backward_hooks and p.requires_grad:  # frozen: no gradient, no hook call
            if name not in names:
                raise argument_error(
                    f"parameter {name!r} has a gradient hook (register_hook), but the "
                    "strategy takes gradients of flat shards, not of this parameter (ZeRO-3), "
                    "so the hook cannot run on its gradient. Use ZeRO(2) or DataParallel, or "
                    "remove the hook."
                )
            hooks[name] = list(p._backward_hooks.values())
    return hooks


def _keep_if(flag: Tensor, old: Mapping[str, Tensor], new: Mapping[str, Tensor]) -> dict:
    return {n: torch.where(flag, old[n], t) if t is not old[n] else t for n, t in new.items()}


def model_loss(outputs: Any) -> Any:
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


def split_micro_batches(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    """Split every batch tensor into ``k`` equal micro-batches along dim 0."""
    if k == 1:
        return [(args, kwargs)]
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] % k:
            raise argument_error(
                f"grad_accum_steps={k} splits every batch tensor into {k} micro-batches along "
                f"dim 0, but batch{pytree.keystr(path)} has {int(leaf.shape[0])} rows. Use a batch "
                f"size divisible by {k} (e.g. DataLoader(..., drop_last=True))."
            )
    micro = []
    for i in range(k):
        chunk = [
            x.tensor_split(k)[i] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves
        ]
        micro.append(pytree.tree_unflatten(chunk, spec))
    return micro


def flat_form(
    fn: StepFunction,
    state: TrainState,
    args: tuple,
    kwargs: dict,
    attribute_entries: list[tuple[str, nn.Module, str]],
    attributes: list[Tensor],
    tensors: list[Tensor],
    *,
    signature: Any,
    inplace: bool,
    meta: dict[str, Any],
) -> tuple[Callable[..., tuple[Tensor, ...]], list[Tensor], int]:
    """The step as the engine traces it: a function of flat tensors (the state's leaves,
    the model's tensor attributes, the batch's tensors), with ``example`` inputs and the
    count of inputs before the batch.

    ``inplace`` (the stateful form): the function writes the new state into the state
    inputs as its last ops and returns the loss alone; otherwise it returns the loss and
    the changed state leaves. ``meta`` receives which leaves change (``"changed"``), which
    attributes the forward assigns (``"reassigned"``), and what the step function notes.
    """
    state_leaves, state_spec = pytree.tree_flatten_with_path(state)
    state_tensors = [t for _, t in state_leaves]
    state_paths = [pytree.keystr(p) for p, _ in state_leaves]
    batch_leaves, batch_spec = pytree.tree_flatten((args, kwargs))
    is_tensor = [isinstance(x, Tensor) for x in batch_leaves]
    constants = [x for x in batch_leaves if not isinstance(x, Tensor)]
    n_state = len(state_tensors)
    n_fixed = n_state + len(attributes)  # inputs before the batch

    def flat_step(*flat: Tensor) -> tuple[Tensor, ...]:
        state_in = pytree.tree_unflatten(list(flat[:n_state]), state_spec)
        tensors, consts = iter(flat[n_fixed:]), iter(constants)
        batch = [next(tensors) if t else next(consts) for t in is_tensor]
        call_args, call_kwargs = pytree.tree_unflatten(batch, batch_spec)
        attribute_inputs = flat[n_state:n_fixed]
        with swap_attributes(attribute_entries, attribute_inputs) as reassigned:
            new_state, loss = fn(state_in, call_args, call_kwargs, meta=meta, signature=signature)
        meta["reassigned"] = sorted(reassigned)
        for i, value in reassigned.items():
            old = attribute_inputs[i]
            if value.shape != old.shape or value.dtype != old.dtype:
                raise argument_error(
                    f"the forward assigned {describe_tensor(value)} to the model's tensor "
                    f"attribute {attribute_entries[i][0]!r}, which holds "
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
    return flat_step, example, n_fixed
