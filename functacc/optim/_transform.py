"""The optimizer interface: pure ``init``/``update`` pairs over name-keyed tensors.

Parameters, gradients and updates are ``dict[str, Tensor]`` keyed by parameter name (the
names of ``model.named_parameters()``). State is data (NamedTuples of tensors), the logic is
pure functions, so a whole optimizer step can be traced into the training graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "GradientTransformation",
    "Params",
    "ParamsUpdate",
    "Schedule",
    "Updates",
    "apply_updates",
    "chain",
    "identity",
]

Params = Mapping[str, Tensor]
Updates = dict[str, Tensor]
Schedule = Callable[[Tensor], Tensor]
"""A learning-rate schedule: a pure function of the update count (0-dim int64 tensor)."""
ParamsUpdate = Callable[[Updates, Any, Params], tuple[dict[str, Tensor], Any]]
"""``update_params(grads, state, params) -> (new_params, new_state)``; ``new_params`` holds
the parameters that had a gradient."""


class GradientTransformation(NamedTuple):
    """A pure optimizer: ``init(params) -> state`` and ``update(grads, state, params)``.

    ``update`` returns ``(updates, new_state)``; the new parameters are
    ``apply_updates(params, updates)``. Parameters that have no gradient (frozen, or unused
    in the forward pass) are absent from ``grads`` and must be left untouched, with their
    state, exactly as ``torch.optim`` skips parameters whose ``.grad`` is ``None``.

    ``update_params`` (optional) computes the new parameters directly. The named optimizers
    provide it so that a compiled step rounds exactly as ``torch.optim`` does (``p + (new -
    p)`` can differ from ``new`` in the last bit); :func:`step_params` uses it when present.

    Example:
        >>> import torch, functacc
        >>> opt = functacc.optim.sgd(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> functacc.optim.apply_updates(params, updates)["w"]
        tensor([0.9000, 0.9000])
    """

    init: Callable[[Params], Any]
    update: Callable[[Updates, Any, Params], tuple[Updates, Any]]
    update_params: ParamsUpdate | None = None


def from_params_update(
    init: Callable[[Params], Any], update_params: ParamsUpdate
) -> GradientTransformation:
    """A transformation defined by how it computes new parameters; ``update`` is derived."""

    def update(grads: Updates, state: Any, params: Params) -> tuple[Updates, Any]:
        new_params, state = update_params(grads, state, params)
        return {n: new - params[n] for n, new in new_params.items()}, state

    return GradientTransformation(init, update, update_params)


def step_params(
    transform: GradientTransformation, grads: Updates, state: Any, params: Params
) -> tuple[dict[str, Tensor], Any]:
    """New parameters (all of them) and new state after one update."""
    if transform.update_params is None:
        updates, state = transform.update(grads, state, params)
        return apply_updates(params, updates), state
    new_params, state = transform.update_params(grads, state, params)
    return {n: new_params.get(n, p) for n, p in params.items()}, state


def identity() -> GradientTransformation:
    """The transformation that passes gradients through unchanged."""
    return GradientTransformation(lambda params: (), lambda grads, state, params: (grads, state))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right; the state is the tuple of their states.

    Example:
        >>> import functacc
        >>> opt = functacc.optim.chain(
        ...     functacc.optim.clip_by_global_norm(1.0), functacc.optim.adamw(lr=1e-3)
        ... )
    """

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def run(grads: Updates, state: tuple, params: Params, *, last_params: bool) -> tuple:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transformations got a state with {len(state)} "
                "entries; pass the state returned by this chain's init()"
            )
        new_state = []
        for i, (transform, sub_state) in enumerate(zip(transforms, state, strict=True)):
            if last_params and i == len(transforms) - 1:
                grads, sub_state = transform.update_params(grads, sub_state, params)
            else:
                grads, sub_state = transform.update(grads, sub_state, params)
            new_state.append(sub_state)
        return grads, tuple(new_state)

    def update(grads: Updates, state: tuple, params: Params) -> tuple[Updates, tuple]:
        return run(grads, state, params, last_params=False)

    def update_params(grads: Updates, state: tuple, params: Params) -> tuple[dict, tuple]:
        return run(grads, state, params, last_params=True)

    exact = bool(transforms) and transforms[-1].update_params is not None
    return GradientTransformation(init, update, update_params if exact else None)


def apply_updates(params: Params, updates: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return ``params + updates``; parameters without an update are returned as they are."""
    return {name: p + updates[name] if name in updates else p for name, p in params.items()}


def first_tensor(params: Params) -> Tensor | None:
    return next(iter(params.values()), None)


def hyperparameters(lr: float | Schedule, values: dict[str, float], like: Tensor | None) -> dict:
    """The initial ``hyperparams`` of a state: 0-dim float64 tensors on the params' device
    (a CUDA graph must read them from device memory, not bake them in)."""
    device = like.device if like is not None else None
    values = {"lr": initial_lr(lr), **values}
    return {
        k: torch.tensor(float(v), dtype=torch.float64, device=device) for k, v in values.items()
    }


def scheduled_lr(lr: float | Schedule, state: Any) -> dict[str, Tensor]:
    """The state's hyperparameters, with ``lr`` evaluated at ``state.count`` if scheduled."""
    hyper = dict(state.hyperparams)
    if callable(lr):
        hyper["lr"] = torch.as_tensor(lr(state.count), dtype=torch.float64).to(hyper["lr"].device)
    return hyper


def initial_lr(lr: float | Schedule) -> float:
    if callable(lr):
        return float(lr(torch.zeros((), dtype=torch.int64)))
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(
            f"lr must be a float or a schedule (a function of the step count); got "
            f"{type(lr).__name__}. Example: lr=1e-3 or lr=functacc.optim.cosine_decay(1e-3, 1000)"
        )
    if lr < 0:
        raise ValueError(f"lr must be >= 0; got {lr}")
    return float(lr)


class EagerKernel:
    """How one torch.optim kernel computes on a tensor of ``dtype``: in its op-math type
    (float32 for bfloat16 and float16 tensors, the dtype itself otherwise), with Python-float
    factors at that precision, rounding to ``dtype`` once at the end.

    A 0-dim tensor factor in a graph would instead be cast to the tensor's dtype first: for
    bfloat16 parameters, Adam's beta2 = 0.999 would become 0.99951171875. So the update
    computes each kernel's arithmetic in the op-math type (:meth:`up`) with the factor as
    that kernel takes it, and rounds where the kernel ends (calling the object). Measured
    on CPU bfloat16 kernels: ``mul``, ``lerp``, ``addcmul``, ``div`` and ``addcdiv`` take
    their scalar in the op-math type (:meth:`factor`); ``add``'s ``alpha`` and a scalar
    added are first rounded to the tensor's dtype (:meth:`alpha`). For float32 and float64
    every conversion is the identity.

    Example:
        >>> import torch
        >>> k = EagerKernel(torch.bfloat16)
        >>> x = torch.ones(2, dtype=torch.bfloat16)
        >>> k(k.up(x) * k.factor(torch.tensor(0.999, dtype=torch.float64))).dtype
        torch.bfloat16
    """

    __slots__ = ("dtype", "math")

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.math = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype

    def up(self, t: Tensor) -> Tensor:
        return t if t.dtype == self.math else t.to(self.math)

    def factor(self, hyperparameter: Tensor) -> Tensor:
        """A scalar of ``mul``, ``lerp``, ``addcmul``, ``div``, ``addcdiv``."""
        return hyperparameter.to(self.math)

    def alpha(self, hyperparameter: Tensor) -> Tensor:
        """``add(other, alpha=...)``'s alpha, or a scalar added: in the tensor's dtype."""
        return hyperparameter.to(self.dtype).to(self.math)

    def __call__(self, t: Tensor) -> Tensor:
        return t if t.dtype == self.dtype else t.to(self.dtype)
