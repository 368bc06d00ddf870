"""A ``functacc.optim`` transformation (:func:`~functacc.optim.as_optimizer`) linked as
functacc's twins of ``torch.optim`` are: :class:`TransformLink`.

Under ``parallel=ZeRO(3)`` a jitted step keeps each parameter as this rank's chunk of a flat
unit and updates only that rank's segment of it (:mod:`functacc.parallel.zero3_jit`). The
twins of SGD, Adam and AdamW get there through :class:`~functacc.optim._torch.
TorchOptimizerLink`; this is the same interface over a transformation, so the same ZeRO
machinery shards its state: the transformation runs on the segments (1-D, as the pure step
ran it before the two front doors shared a pipeline), its per-parameter state sharded like
the parameters, and :func:`~functacc.optim.global_norm` sums its squares over the shard
group. A transformation of your own that reads a parameter's shape would see the segment's.

The state takes the twins' form: one group, a named tuple whose fields are dicts from
parameter name to tensor (one field per key of the per-parameter state, such as
``"[1].exp_avg"`` of ``chain(clip_by_global_norm(...), adamw(...))``) and ``shared``, the
leaves that belong to no parameter (the step count, the hyperparameters).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from ._as_torch import TransformOptimizer
from ._clip import summed_over
from ._transform import GradientTransformation, from_params_update, step_params

__all__ = ["TransformLink"]


class TransformLink:
    """``optimizer`` (a :class:`TransformOptimizer`) with the interface of
    :class:`~functacc.optim._torch.TorchOptimizerLink`; ``names`` maps each parameter (by
    ``id``) to its name among the step's modules.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = functacc.optim.as_optimizer(
        ...     model.named_parameters(), functacc.optim.adamw(1e-3)
        ... )
        >>> link = TransformLink(opt, {id(p): f"m.{n}" for n, p in model.named_parameters()})
        >>> state = link.read_state(link.params, copy=True)
        >>> sorted(state[0]._fields), sorted(state[0].s0)
        (['s0', 's1', 's2', 'shared'], ['m.bias', 'm.weight'])
    """

    def __init__(self, optimizer: TransformOptimizer, names: Mapping[int, str]):
        if optimizer.owned is not None:
            raise AssertionError("a TransformOptimizer that owns some parameters (ZeRO-1/2)")
        self.optimizer = optimizer
        own = optimizer._named()
        self.params: dict[str, Tensor] = {names[id(p)]: p for p in own.values()}
        self.groups: list[list[str]] = [list(self.params)]
        self._own = {names[id(p)]: n for n, p in own.items()}  # step's name -> its own
        self._step_name = {n: s for s, n in self._own.items()}
        layout = optimizer._layout
        keys = list(dict.fromkeys(key for name, key in layout.slots if name is not None))
        self._field = {key: f"s{i}" for i, key in enumerate(keys)}
        self._form = collections.namedtuple("TransformState", [*self._field.values(), "shared"])
        # Set by ZeRO: the process group global_norm sums over (None: one process).
        self.sum_group: Any = None

    # -- TorchOptimizerLink's interface: a transformation holds no hyperparameters in
    # param_groups (its learning rate and schedule live in the transformation).
    def same_groups(self) -> bool:
        return True

    def forget_poll(self) -> None:
        pass

    def poll(self) -> bool:
        return False

    def structure_key(self) -> tuple:
        return ("functacc.optim", id(self.optimizer.transform))

    def hyper_values(self) -> list[dict[str, float]]:
        return [{}]

    def sync_hyperparams(self, state: Any, *, force: bool = False) -> None:
        pass

    def transform(self, groups: list[list[str]] | None = None) -> GradientTransformation:
        """The transformation over the state's form and the step's parameter names."""
        transform = self.optimizer.transform

        def init(params: Mapping[str, Tensor]) -> tuple:
            return (self.to_form(transform.init(self._renamed(params))),)

        def update_params(grads: Mapping, state: tuple, params: Mapping) -> tuple[dict, tuple]:
            like = next(iter(self.params.values()))
            with summed_over(self.sum_group, like):
                new, tree = step_params(
                    transform, self._renamed(grads), self.to_tree(state[0]), self._renamed(params)
                )
            return {self._step_name[n]: t for n, t in new.items()}, (self.to_form(tree),)

        return from_params_update(init, update_params)

    def read_state(self, params: Mapping[str, Tensor], *, copy: bool) -> tuple:
        """The optimizer's state now, in the twins' form (cloned with ``copy=True``)."""
        form = self.to_form(self.optimizer.transform_state())
        return (pytree.tree_map(lambda t: t.clone(), form) if copy else form,)

    def install(self, state: tuple, names_with_grads: set[str]) -> None:
        """Make the optimizer hold ``state`` (ZeRO: gathered whole, for ``state_dict()``)."""
        self.optimizer._put(self.to_tree(state[0]))
        self.optimizer.stepped = True

    # -- the two forms of the state
    def to_form(self, tree: Any) -> Any:
        fields: dict[str, dict[str, Tensor]] = {f: {} for f in self._field.values()}
        shared = []
        slots = self.optimizer._layout.slots
        leaves = pytree.tree_leaves(tree)
        for (name, key), leaf in zip(slots, leaves, strict=True):
            if name is None:
                shared.append(leaf)
            else:
                fields[self._field[key]][self._step_name[name]] = leaf
        return self._form(**fields, shared=tuple(shared))

    def to_tree(self, form: Any) -> Any:
        shared = iter(form.shared)
        leaves = [
            next(shared) if name is None else getattr(form, self._field[key])[self._step_name[name]]
            for name, key in self.optimizer._layout.slots
        ]
        return pytree.tree_unflatten(leaves, self.optimizer._layout.spec)

    def _renamed(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {self._own[n]: t for n, t in tensors.items()}
