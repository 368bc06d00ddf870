"""torchmetrics' checks of tensor values on the host, made in a traced step's graph.

A metric updated in the step (``self.train_acc(preds, y)``, ``self.train_loss(loss)``)
checks what it is given by reading values on the host, which a graph traced once cannot:

- the aggregators (``MeanMetric``, ``SumMetric``, ...) look for NaN (``if nans.any()``);
  their default ``nan_strategy="warn"`` drops NaN values with a warning;
- the multiclass counts behind ``Accuracy``, ``F1Score``, ``Precision`` ... count the
  distinct values of integer predictions and targets (``len(torch.unique(t))``) against
  ``num_classes``;
- on CPU, ``normalize_logits_if_needed`` tests whether predictions are probabilities
  already before it applies softmax or sigmoid.

While a step body is traced, each is made in the graph from the same values: the first two
are ``torch._assert_async`` of eager's condition (a call that meets NaN, or more classes
than declared, fails naming the fix, before any state is written), the third a
``torch.where`` (as torchmetrics itself does on CUDA). A call that passes computes what
eager computes. A torchmetrics whose functions are not the ones expected here is left as
it is (its checks then fail the trace with advice: ``validate_args=False``).

Example:
    >>> import torch
    >>> with metric_checks_in_graph():
    ...     torch.ones(2).sum().item()
    2.0
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["metric_checks_in_graph"]

_NAN_ACTIONS = {"error": "raise", "warn": "warn and drop them", "ignore": "drop them"}


@contextlib.contextmanager
def metric_checks_in_graph() -> Iterator[None]:
    """While inside (a trace): torchmetrics' host checks are made in the graph."""
    if "torchmetrics" not in sys.modules:  # not imported: no metric in the step
        yield
        return
    with contextlib.ExitStack() as stack:
        aggregation = sys.modules.get("torchmetrics.aggregation")
        if aggregation is not None:
            base = aggregation.BaseAggregator
            real = base._cast_and_nan_check_input
            base._cast_and_nan_check_input = _nan_checked(real)
            stack.callback(setattr, base, "_cast_and_nan_check_input", real)
        for name, make, parameters in _SWAPPED:
            stack.enter_context(_swapped(name, make, parameters))
        yield


def _nan_checked(real: Callable) -> Callable:
    def checked(self: Any, x: Any, weight: Any = None) -> tuple[Any, Any]:
        strategy = self.nan_strategy
        if strategy == "disable":
            return real(self, x, weight)

        def as_tensor(value: Any) -> torch.Tensor:
            if isinstance(value, torch.Tensor):
                return value
            return torch.as_tensor(value, dtype=self.dtype, device=self.device)

        x = as_tensor(x)
        weight = torch.ones_like(x) if weight is None else as_tensor(weight)
        action = _NAN_ACTIONS.get(strategy, f"put {strategy} in their place")
        torch._assert_async(
            ~(x.isnan().any() | weight.isnan().any()),
            f"functacc: {type(self).__name__} got NaN values; with nan_strategy={strategy!r} "
            f"eager would {action}, which a graph traced once cannot (checked in the graph). "
            "Fix: nan_strategy='disable' where the values cannot be NaN, or update the metric "
            "outside the jitted step.",
        )
        return x.to(self.dtype), weight.to(self.dtype)

    return checked


def _normalized(real: Callable) -> Callable:
    def normalized(tensor: torch.Tensor, normalization: Any) -> torch.Tensor:
        if not normalization:
            return tensor
        made = tensor.sigmoid() if normalization == "sigmoid" else torch.softmax(tensor, dim=1)
        return torch.where(((tensor >= 0) * (tensor <= 1)).all(), tensor, made)

    return normalized


def _classes_checked(real: Callable) -> Callable:
    def validated(
        preds: torch.Tensor,
        target: torch.Tensor,
        num_classes: int | None,
        multidim_average: str = "global",
        ignore_index: int | None = None,
    ) -> None:
        # The shape checks as torchmetrics makes them (num_classes only in the first).
        wide = preds.ndim == target.ndim + 1 and num_classes is not None
        if wide and preds.shape[1] != num_classes:
            real(preds, target, num_classes, multidim_average, ignore_index)  # raises
        real(preds, target, None, multidim_average, ignore_index)
        if num_classes is None or preds.is_floating_point():
            return  # torchmetrics counts the classes of integer predictions only
        expected = num_classes if ignore_index is None else num_classes + 1
        for t, name in ((target, "target"), (preds, "preds")):
            torch._assert_async(
                _distinct(t) <= expected,
                f"functacc: more distinct values in `{name}` than expected ({expected}), "
                "torchmetrics' argument check (made in the graph). Fix: give values in "
                "{0, ..., num_classes - 1}, or build the metric with validate_args=False.",
            )

    return validated


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """How many distinct values ``t`` holds, as a tensor (``torch.unique``'s length is a
    size the graph cannot know)."""
    values = t.flatten().sort().values
    return (values[1:] != values[:-1]).sum() + int(values.numel() > 0)


# (function name, its stand-in's maker, the parameters the stand-in expects)
_SWAPPED: tuple[tuple[str, Callable[[Callable], Callable], tuple[str, ...]], ...] = (
    ("normalize_logits_if_needed", _normalized, ("tensor", "normalization")),
    (
        "_multiclass_stat_scores_tensor_validation",
        _classes_checked,
        ("preds", "target", "num_classes", "multidim_average", "ignore_index"),
    ),
)


@contextlib.contextmanager
def _swapped(
    name: str, make: Callable[[Callable], Callable], parameters: tuple[str, ...]
) -> Iterator[None]:
    """Each torchmetrics module's own reference to its function ``name`` (its users import
    it by name) is the stand-in while inside, where the function is the expected one."""
    holders = [
        m
        for key, m in list(sys.modules.items())
        if key.startswith("torchmetrics") and callable(vars(m).get(name))
    ]
    real = vars(holders[0])[name] if holders else None
    if real is None or tuple(inspect.signature(real).parameters) != parameters:
        yield  # another torchmetrics: its own function (a failed trace names the fix)
        return
    holders = [m for m in holders if vars(m)[name] is real]
    stand_in = make(real)
    for module in holders:
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module in holders:
            setattr(module, name, real)
