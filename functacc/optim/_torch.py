"""Bridge from ``torch.optim`` optimizers to pure transformations, and back.

``from_torch(opt)`` builds the equivalent :class:`GradientTransformation` (one per param
group, every group's hyperparameters honoured). :class:`TorchOptimizerLink` additionally keeps
the torch optimizer live while a compiled step trains: its ``state`` holds the very tensors
the compiled step updates, and its ``param_groups`` learning rates feed the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import foreign_parameter_error, user_stacklevel
from ._adam import AdamState, adam, step_dtype
from ._partition import partition
from ._sgd import SGDState, sgd
from ._transform import GradientTransformation, Params

__all__ = ["TorchOptimizerLink", "check_owned_parameters", "from_torch"]

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
SUPPORTED_NAMES = "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW"


def check_owned_parameters(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], label: str = "optimizer"
) -> None:
    """Every parameter of ``optimizer`` is one of the step's (a key of ``names``, by id)."""
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in names:
                raise foreign_parameter_error(label, i, j, tuple(p.shape))


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _class_name(obj: Any) -> str:
    module = type(obj).__module__
    if module.startswith("torch.optim."):
        module = "torch.optim"  # the public name, not torch.optim.rmsprop
    return f"{module}.{type(obj).__qualname__}"


def _check_supported(optimizer: Any) -> None:
    if isinstance(optimizer, GradientTransformation):
        return
    if type(optimizer) not in SUPPORTED:
        raise TypeError(
            f"functacc supports the optimizers {SUPPORTED_NAMES} or a "
            f"functacc.optim.GradientTransformation; got {_class_name(optimizer)}. Use one "
            "of those, or write the update as a "
            "GradientTransformation (see functacc.optim.chain)."
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise ValueError(
                f"optimizer.param_groups[{i}] has differentiable=True, which functacc does not "
                "support (the optimizer step is not differentiated through); create the "
                "optimizer with differentiable=False"
            )
        if group.get("capturable"):
            _check_capturable(i, group)
    if any(group.get("fused") for group in optimizer.param_groups):
        warnings.warn(
            f"{_class_name(optimizer)}(fused=True): functacc compiles its own update into the "
            "step, with the arithmetic of torch's for-loop and foreach implementations (equal "
            "to fused=False bit for bit), not torch's fused kernel, whose float rounding "
            "differs (by about 1e-9 over a few steps of a small model). Create the optimizer "
            "with fused=False to compare with eager bit for bit.",
            stacklevel=user_stacklevel(),
        )


def _check_capturable(i: int, group: Mapping) -> None:
    # Eager's step() asserts this (torch.optim's single-tensor and foreach paths): a
    # capturable optimizer keeps its step counts on the parameters' device, which must be
    # one that CUDA-graph-style capture supports. functacc would run; eager fails.
    from torch.optim.optimizer import _get_capturable_supported_devices

    supported = _get_capturable_supported_devices()
    devices = sorted({p.device.type for p in group["params"]} - set(supported))
    if devices:
        raise ValueError(
            f"optimizer.param_groups[{i}] has capturable=True with parameters on {devices}; "
            f"capturable needs parameters on one of {supported} (eager PyTorch's step() "
            "fails the same way). Create the optimizer with capturable=False (the default): "
            "functacc compiles the whole step, and on CUDA keeps the step count on the GPU "
            "itself."
        )


# Every param_groups entry that the structure or the hyperparameter values are read from.
_WATCHED = (
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "nesterov",
    "maximize",
    "betas",
    "eps",
    "amsgrad",
    "decoupled_weight_decay",
)


def _structure(optimizer: torch.optim.Optimizer, group: Mapping) -> tuple:
    """The entries of ``group`` that shape the graph, as ``(name, value)`` pairs (retrace
    reasons name the one that changed)."""
    if isinstance(optimizer, torch.optim.SGD):
        return (
            ("nesterov", bool(group["nesterov"])),
            ("maximize", bool(group["maximize"])),
            ("momentum != 0", _float(group["momentum"]) != 0),
            ("weight_decay != 0", _float(group["weight_decay"]) != 0),
        )
    return (
        ("amsgrad", bool(group["amsgrad"])),
        ("maximize", bool(group["maximize"])),
        ("decoupled weight decay", _decoupled(optimizer, group)),
        ("weight_decay != 0", _float(group["weight_decay"]) != 0),
        ("tensor entries", tuple(sorted(_tensor_dtypes(group).items(), key=str))),
    )


def _tensor_dtypes(group: Mapping) -> dict[str, torch.dtype]:
    """Adam's hyperparameters that the group holds as tensors, and their dtypes: torch does
    their scalar arithmetic in that dtype."""
    beta1, beta2 = group["betas"]
    values = {"lr": group["lr"], "beta1": beta1, "beta2": beta2}
    return {k: v.dtype for k, v in values.items() if isinstance(v, torch.Tensor)}


def _decoupled(optimizer: torch.optim.Optimizer, group: Mapping) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _hyper_values(optimizer: torch.optim.Optimizer, group: Mapping) -> dict[str, float]:
    if isinstance(optimizer, torch.optim.SGD):
        keys = ("lr", "momentum", "dampening", "weight_decay")
        return {k: _float(group[k]) for k in keys}
    beta1, beta2 = group["betas"]
    return {
        "lr": _float(group["lr"]),
        "beta1": _float(beta1),
        "beta2": _float(beta2),
        "eps": _float(group["eps"]),
        "weight_decay": _float(group["weight_decay"]),
    }


def _group_transform(optimizer: torch.optim.Optimizer, group: Mapping) -> GradientTransformation:
    lr = _float(group["lr"])
    if isinstance(optimizer, torch.optim.SGD):
        return sgd(
            lr,
            momentum=_float(group["momentum"]),
            dampening=_float(group["dampening"]),
            weight_decay=_float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )
    return adam(
        lr,
        betas=tuple(_float(b) for b in group["betas"]),
        eps=_float(group["eps"]),
        weight_decay=_float(group["weight_decay"]),
        amsgrad=bool(group["amsgrad"]),
        maximize=bool(group["maximize"]),
        decoupled_weight_decay=_decoupled(optimizer, group),
        tensor_dtypes=_tensor_dtypes(group),
    )


class TorchOptimizerLink:
    """Keeps a ``torch.optim`` optimizer and the pure optimizer state of a step in sync.

    ``names`` maps each parameter tensor (by ``id``) to its name in the model.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str]):
        _check_supported(optimizer)
        self.optimizer = optimizer
        self.groups: list[list[str]] = []
        self.params: dict[str, Tensor] = {}
        check_owned_parameters(optimizer, names)
        for group in optimizer.param_groups:
            group_names = []
            for p in group["params"]:
                group_names.append(names[id(p)])
                self.params[names[id(p)]] = p
            self.groups.append(group_names)
        self._ids = self._group_ids()
        self._values: list[dict[str, float]] | None = None
        self._raw: tuple | None = None
        self._raw_has_tensors = False

    def _group_ids(self) -> list[list[int]]:
        return [[id(p) for p in g["params"]] for g in self.optimizer.param_groups]

    def same_groups(self) -> bool:
        """Whether ``param_groups`` still holds the parameters this link was built on, in
        the same groups (``add_param_group()`` adds a group)."""
        return self._group_ids() == self._ids

    def forget_poll(self) -> None:
        """Make the next :meth:`poll` say yes (a change it reported was not taken up)."""
        self._raw = None

    def poll(self) -> bool:
        """Whether ``param_groups`` may have changed since the last poll: a C-level read of
        the entries, compared as they are (a scheduler writes new floats). Tensor entries
        can change in place, so with any of them every poll says yes."""
        # With each group's parameter count: add_param_group() or a parameter appended to a
        # group is a change too (same_groups() then compares the parameters themselves).
        raw = tuple((*map(g.get, _WATCHED), len(g["params"])) for g in self.optimizer.param_groups)
        if not self._raw_has_tensors and raw == self._raw:
            return False
        self._raw = raw
        self._raw_has_tensors = any(
            isinstance(v, Tensor) or (type(v) is tuple and any(isinstance(b, Tensor) for b in v))
            for group in raw
            for v in group
        )
        return True

    # -- hyperparameters -------------------------------------------------------------
    def structure_key(self) -> tuple:
        """What changes the graph: the optimizer's flags and which terms are zero.

        Numeric hyperparameters are tensors in the state, so schedules on them (lr, but
        also OneCycleLR's momentum or betas) never retrace.
        """
        return tuple(_structure(self.optimizer, g) for g in self.optimizer.param_groups)

    def transform(self, groups: list[list[str]] | None = None) -> GradientTransformation:
        """The optimizer as a pure transformation; ``groups`` renames the parameters of each
        param group (ZeRO updates flat shards, not the named parameters)."""
        _check_supported(self.optimizer)
        transforms = [_group_transform(self.optimizer, g) for g in self.optimizer.param_groups]
        return partition(transforms, self.groups if groups is None else groups)

    def hyper_values(self) -> list[dict[str, float]]:
        return [_hyper_values(self.optimizer, g) for g in self.optimizer.param_groups]

    def sync_hyperparams(self, state: tuple | list, *, force: bool = False) -> None:
        """Write changed ``param_groups`` values (lr, momentum, betas, ...) into the live
        state tensors, so they take effect at the next step without a retrace."""
        values = self.hyper_values()
        if force or values != self._values:
            for group_state, group_values in zip(state, values, strict=True):
                for k, v in group_values.items():
                    group_state.hyperparams[k].fill_(v)
            self._values = values

    # -- state -----------------------------------------------------------------------
    def read_state(self, params: Params, *, copy: bool) -> tuple:
        """The pure state equal to the optimizer's current state (zeros where torch has
        none yet). With ``copy=False`` the tensors are the optimizer's own."""
        transform = self.transform()
        fresh = transform.init({n: params[n] for g in self.groups for n in g})
        out = []
        for group_names, group_state in zip(self.groups, fresh, strict=True):
            out.append(self._read_group(group_names, group_state, copy=copy))
        self.sync_hyperparams(out, force=True)
        return tuple(out)

    def _existing(self, name: str, key: str, like: Tensor, *, copy: bool) -> Tensor | None:
        value = self.optimizer.state.get(self.params[name], {}).get(key)
        if value is None:
            return None
        if not isinstance(value, Tensor):
            value = torch.tensor(value)
        if key != "step" and (value.shape != like.shape or value.dtype != like.dtype):
            raise ValueError(
                f"optimizer state {key!r} of parameter {name!r} has shape "
                f"{tuple(value.shape)} and dtype {value.dtype}, but the parameter has shape "
                f"{tuple(like.shape)} and dtype {like.dtype}; was the optimizer state loaded "
                "from a different model?"
            )
        value = value.to(like.device)
        return value.clone() if copy else value

    def _read_group(self, names: list[str], fresh: Any, *, copy: bool) -> Any:
        if isinstance(fresh, SGDState):
            buffers, initialized = dict(fresh.momentum_buffer), dict(fresh.initialized)
            for n in buffers:
                existing = self._existing(n, "momentum_buffer", buffers[n], copy=copy)
                if existing is not None:
                    buffers[n] = existing
                    initialized[n] = torch.ones_like(initialized[n])
            return fresh._replace(momentum_buffer=buffers, initialized=initialized)
        assert isinstance(fresh, AdamState)
        fields = {}
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            values = dict(getattr(fresh, key))
            for n in values:
                existing = self._existing(n, key, values[n], copy=copy)
                if existing is not None:
                    values[n] = existing.to(step_dtype()) if key == "step" else existing
            fields[key] = values
        return fresh._replace(**fields)

    def install(self, state: tuple, names_with_grads: set[str]) -> None:
        """Make ``optimizer.state`` hold the tensors of ``state``, for every parameter that
        has been updated (torch creates state only for parameters that had a gradient)."""
        for n in self.params:
            tensors = self.entries(state, n) if n in names_with_grads else None
            if tensors:  # plain SGD keeps no state; don't create empty entries
                self.optimizer.state[self.params[n]].update(tensors)

    def entries(self, state: tuple, name: str) -> dict[str, Tensor]:
        """The entries torch's ``optimizer.state`` holds for parameter ``name``, taken from
        ``state`` (the pure twin's)."""
        for group_names, group_state in zip(self.groups, state, strict=True):
            if name not in group_names:
                continue
            if isinstance(group_state, SGDState):
                tensors = {"momentum_buffer": group_state.momentum_buffer.get(name)}
            else:
                tensors = {
                    "step": group_state.step[name],
                    "exp_avg": group_state.exp_avg[name],
                    "exp_avg_sq": group_state.exp_avg_sq[name],
                    "max_exp_avg_sq": group_state.max_exp_avg_sq.get(name),
                }
            return {k: v for k, v in tensors.items() if v is not None}
        return {}


def from_torch(
    optimizer: torch.optim.Optimizer, *, named_parameters: Mapping[str, Tensor] | None = None
) -> GradientTransformation:
    """The pure equivalent of a ``torch.optim`` optimizer (SGD, Adam or AdamW).

    Every param group becomes its own transformation with that group's hyperparameters.
    Parameters are named as in ``named_parameters`` (e.g. ``dict(model.named_parameters())``),
    or ``"<group>.<index>"`` when it is not given. ``init`` starts from the optimizer's current
    state (copied), so a half-trained optimizer continues where it was.

    Example:
        >>> import torch, functacc
        >>> model = torch.nn.Linear(2, 2)
        >>> torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> opt = functacc.optim.from_torch(
        ...     torch_opt, named_parameters=dict(model.named_parameters())
        ... )
        >>> state = opt.init(dict(model.named_parameters()))
    """
    _check_supported(optimizer)
    if named_parameters is None:
        names = {
            id(p): f"{i}.{j}"
            for i, g in enumerate(optimizer.param_groups)
            for j, p in enumerate(g["params"])
        }
    else:
        names = {id(p): n for n, p in named_parameters.items()}
    link = TorchOptimizerLink(optimizer, names)
    transform = link.transform()

    def init(params: Params) -> tuple:
        return link.read_state({n: p.detach() for n, p in params.items()}, copy=True)

    return GradientTransformation(init, transform.update, transform.update_params)
