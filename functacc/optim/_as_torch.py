"""A pure transformation as a ``torch.optim.Optimizer``: ``as_optimizer``.

``functacc.optim`` transformations are pure (``init``/``update`` over name-keyed tensors);
a loop written for PyTorch calls ``opt.step()`` and ``opt.zero_grad()``. ``as_optimizer``
gives the one to the other: an optimizer over named parameters whose ``step()`` reads the
parameters' ``.grad``, runs the transformation and writes the new parameters and state
into the tensors it holds, in place. It runs eagerly, in a body compiled with
:func:`functacc.jit` (whose tracer follows its ``step()`` like any optimizer's) and in
``compile_step``.

Its ``param_groups`` hold no hyperparameters: the learning rate and its schedule live in
the transformation (``functacc.optim.cosine_decay``, ...), so ``torch.optim.lr_scheduler``
does not apply. The transformation's state is one tree, not a state per parameter: its
leaves are kept under the first parameter (``opt.state[first]["leaf0"]``, ...) so that
``state_dict()`` and ``load_state_dict()`` carry them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ._transform import GradientTransformation, step_params

__all__ = ["TransformOptimizer", "as_optimizer"]


class TransformOptimizer(torch.optim.Optimizer):
    """A :class:`GradientTransformation` stepping named parameters in place; build it
    with :func:`as_optimizer`."""

    def __init__(self, named_params: Mapping[str, Tensor], transform: GradientTransformation):
        self.transform = transform
        self.names = list(named_params)
        super().__init__(list(named_params.values()), {})
        with torch.no_grad():
            state = transform.init({n: p.detach() for n, p in named_params.items()})
        leaves, self._spec = pytree.tree_flatten(state)
        self.state[self._first] = {f"leaf{i}": leaf for i, leaf in enumerate(leaves)}
        self.stepped = False  # its state is still the transformation's init (see rebuild_state)

    def rebuild_state(self) -> None:
        """Make the transformation's state again from the parameters as they are now, before
        the first step (tensor parallelism splits the parameters in place after the
        optimizer was built over the whole ones)."""
        if self.stepped:
            raise ValueError(
                "rebuild_state() of an optimizer that has stepped or loaded a state would drop "
                "that state"
            )
        with torch.no_grad():
            state = self.transform.init({n: p.detach() for n, p in self._named().items()})
        leaves, self._spec = pytree.tree_flatten(state)
        self.state[self._first] = {f"leaf{i}": leaf for i, leaf in enumerate(leaves)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the transformation's leaves
        keep their dtypes: torch casts floating state to the parameter's dtype, which would
        round float64 hyperparameters and turn the int64 count into a float."""
        state_dict = dict(state_dict)
        state = dict(state_dict["state"])
        first = self.param_groups[0]["params"][0]
        leaves = state.pop(state_dict["param_groups"][0]["params"][0], {})
        super().load_state_dict({**state_dict, "state": state})
        self.state[first] = {k: v.to(device=first.device).clone() for k, v in leaves.items()}
        self.stepped = True

    @property
    def _first(self) -> Tensor:
        return self.param_groups[0]["params"][0]

    def _named(self) -> dict[str, Tensor]:
        params = self.param_groups[0]["params"]
        if len(self.param_groups) != 1 or len(params) != len(self.names):
            raise ValueError(
                "an optimizer from functacc.optim.as_optimizer keeps the parameters it was "
                f"built with ({len(self.names)} in one group); got "
                f"{[len(g['params']) for g in self.param_groups]} in its param_groups. "
                "Build a new one with as_optimizer(...) instead of add_param_group()."
            )
        return dict(zip(self.names, params, strict=True))

    def transform_state(self) -> Any:
        """The transformation's state, as its ``init`` made it: the live tensors."""
        entries = self.state[self._first]
        return pytree.tree_unflatten([entries[f"leaf{i}"] for i in range(len(entries))], self._spec)

    def load_transform_state(self, state: Any) -> None:
        """Hold ``state`` (a tree shaped as the transformation's ``init`` makes it)."""
        leaves, spec = pytree.tree_flatten(state)
        if spec != self._spec:
            raise ValueError(
                "load_transform_state() expects a state shaped like this optimizer's "
                f"transformation makes it; got {spec}, expected {self._spec}"
            )
        self.state[self._first] = {f"leaf{i}": leaf for i, leaf in enumerate(leaves)}
        self.stepped = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update: the transformation of the parameters that have a ``.grad``; the
        others, and their state, are left untouched (as ``torch.optim`` skips them)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._named()
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        if not grads:
            return loss
        state = self.transform_state()
        self.stepped = True
        new_params, new_state = step_params(self.transform, grads, state, params)
        for n in grads:
            params[n].copy_(new_params[n])
        for old, new in zip(pytree.tree_leaves(state), pytree.tree_leaves(new_state), strict=True):
            if old is not new:
                old.copy_(new)
        return loss


def as_optimizer(
    named_params: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
    transform: GradientTransformation,
) -> TransformOptimizer:
    """``transform`` as a ``torch.optim.Optimizer`` over ``named_params``: ``opt.step()``
    applies it to the parameters' gradients in place, eagerly or in a compiled step.

    Frozen parameters (``requires_grad=False``) are left out, as ``compile_step`` leaves
    them out of a transformation.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Linear(4, 2)
        >>> schedule = functacc.optim.cosine_decay(1e-3, 100)
        >>> opt = functacc.optim.as_optimizer(
        ...     model.named_parameters(), functacc.optim.adamw(schedule)
        ... )
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> int(opt.transform_state().count)
        1
    """
    if not isinstance(transform, GradientTransformation):
        raise TypeError(
            "as_optimizer(named_params, transform) expects a functacc.optim "
            f"GradientTransformation; got {type(transform).__name__}"
        )
    items = named_params.items() if isinstance(named_params, Mapping) else named_params
    named = {n: p for n, p in items if p.requires_grad}
    if not named:
        raise ValueError("as_optimizer() got no trainable parameter (requires_grad=True)")
    return TransformOptimizer(named, transform)
