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
does not apply. The transformation's state is kept as torch keeps an optimizer's: what
belongs to one parameter (Adam's moments, under an entry of the state's per-parameter
dicts) in ``opt.state[param]``, keyed by its path in the state (``".exp_avg"``); the rest
(the step count, the hyperparameters) in ``opt.param_groups[0]``, keyed ``"state.count"``
and so on. So ``state_dict()`` and ``load_state_dict()`` carry it, and ZeRO can give each
rank the state of the parameters it owns (:meth:`TransformOptimizer.own`).
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ._clip import summed_over
from ._transform import GradientTransformation, step_params

__all__ = ["TransformOptimizer", "as_optimizer"]


class _Layout(NamedTuple):
    """Where each leaf of a state tree lives: ``(name, key)``, the parameter it belongs to
    (``None``: the group's) and its key there."""

    spec: Any
    slots: list[tuple[str | None, str]]


def _layout(state: Any, names: Collection[str]) -> _Layout:
    flat, spec = pytree.tree_flatten_with_path(state)
    slots = []
    for path, _ in flat:
        at = next(
            (i for i, k in enumerate(path) if isinstance(k, pytree.MappingKey) and k.key in names),
            None,
        )
        if at is None:
            slots.append((None, "state" + pytree.keystr(path)))
        else:
            slots.append((path[at].key, pytree.keystr(path[:at] + path[at + 1 :])))
    return _Layout(spec, slots)


class TransformOptimizer(torch.optim.Optimizer):
    """A :class:`GradientTransformation` stepping named parameters in place; build it
    with :func:`as_optimizer`."""

    def __init__(self, named_params: Mapping[str, Tensor], transform: GradientTransformation):
        self.transform = transform
        self.names = list(named_params)
        super().__init__(list(named_params.values()), {})
        self.owned: frozenset[str] | None = None  # ZeRO: the parameters this rank steps
        self._sum_group: Any = None
        self._split: tuple[frozenset[str], Any] | None = None  # TensorParallel's slices
        self._make_state()
        self.stepped = False  # its state is still the transformation's init (see rebuild_state)

    def _make_state(self) -> None:
        names = self._stepping()
        params = self._named()
        with torch.no_grad():
            state = self.transform.init({n: params[n].detach() for n in names})
        self._layout = _layout(state, names)
        self._put(state)

    def _put(self, state: Any) -> None:
        params, group = self._named(), self.param_groups[0]
        for (name, key), leaf in zip(self._layout.slots, pytree.tree_leaves(state), strict=True):
            if name is None:
                group[key] = leaf
            else:
                self.state[params[name]][key] = leaf

    def _stepping(self) -> list[str]:
        return [n for n in self.names if self.owned is None or n in self.owned]

    def own(self, names: Collection[str], group: Any) -> None:
        """Step only the parameters ``names`` (ZeRO: those this rank owns; their state is
        kept, the others' dropped), summing :func:`~functacc.optim.global_norm`'s squares
        over the process ``group``."""
        keep = frozenset(names)
        params = self._named()
        for n in self.names:
            if n not in keep:
                self.state.pop(params[n], None)
        self.owned, self._sum_group = keep, group
        kept = {n: params[n].detach() for n in self._stepping()}
        with torch.no_grad():
            self._layout = _layout(self.transform.init(kept), kept)

    def split_over(self, names: Collection[str], group: Any) -> None:
        """Tensor parallelism: the parameters ``names`` hold this rank's slices, so
        :func:`~functacc.optim.global_norm` sums their squares over ``group`` (the others
        are whole on every rank of it)."""
        self._split = (frozenset(names), group)

    def rebuild_state(self) -> None:
        """Make the transformation's state again from the parameters as they are now, before
        the first step (tensor parallelism splits the parameters in place after the
        optimizer was built over the whole ones)."""
        if self.stepped:
            raise ValueError(
                "rebuild_state() of an optimizer that has stepped or loaded a state would drop "
                "that state"
            )
        self._make_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the state keeps its dtypes
        (torch casts floating state to the parameter's dtype, which would round a float32
        step count kept for bfloat16 parameters), and a state of another transformation is
        an error that changes nothing."""
        saved, saved_group = state_dict["state"], state_dict["param_groups"][0]
        number = dict(zip(self.names, saved_group["params"], strict=False))
        missing = [
            key if name is None else f"{name}: {key}"
            for name, key in self._layout.slots
            if key not in (saved_group if name is None else saved.get(number.get(name), {}))
        ]
        if missing:
            raise ValueError(
                "the loaded state is not this transformation's: it lacks "
                f"{missing[:4]}{' ...' if len(missing) > 4 else ''}. Save and load with the "
                "same functacc.optim transformation over the same parameters."
            )
        # torch runs the post-hooks (ZeRO shards what was loaded) at the end of its own
        # load_state_dict(): here, after the state below is in place.
        hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
        try:
            super().load_state_dict({**state_dict, "state": {}})
        finally:
            self._optimizer_load_state_dict_post_hooks = hooks
        params, group = self._named(), self.param_groups[0]
        first = params[self.names[0]]
        for key in [k for k in group if k.startswith("state")]:
            group[key] = group[key].to(device=first.device)
        for name in self._stepping():
            entries = saved.get(number[name], {})
            p = params[name]
            self.state[p] = {k: v.to(device=p.device).clone() for k, v in entries.items()}
        self.stepped = True
        for hook in hooks.values():
            hook(self)

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
        """The transformation's state, as its ``init`` makes it: the live tensors."""
        params, group = self._named(), self.param_groups[0]
        leaves = [
            group[key] if name is None else self.state[params[name]][key]
            for name, key in self._layout.slots
        ]
        return pytree.tree_unflatten(leaves, self._layout.spec)

    def load_transform_state(self, state: Any) -> None:
        """Hold ``state`` (a tree shaped as the transformation's ``init`` makes it)."""
        spec = pytree.tree_structure(state)
        if spec != self._layout.spec:
            raise ValueError(
                "load_transform_state() expects a state shaped like this optimizer's "
                f"transformation makes it; got {spec}, expected {self._layout.spec}"
            )
        self._put(state)
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
        if not grads:  # the same on every rank: ZeRO averages the gradients whole
            return loss
        stepping = self._stepping()
        grads = {n: g for n, g in grads.items() if self.owned is None or n in self.owned}
        state = self.transform_state()
        self.stepped = True
        with summed_over(self._sum_group, params[self.names[0]], self._split):
            new_params, new_state = step_params(
                self.transform, grads, state, {n: params[n] for n in stepping}
            )
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
