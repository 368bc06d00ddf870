"""``torch.optim.swa_utils.AveragedModel.update_parameters`` inside a traced step.

Eager's ``update_parameters(model)`` decides on the host: the first time
(``n_averaged == 0``) it copies the model's weights, afterwards (``n_averaged > 0``) it
averages them in. A graph traced once cannot branch on ``n_averaged``'s value, so while a
step body is traced the method computes both and selects with ``torch.where``: the average
is computed on copies by torch's own averaging functions (``avg_fn``, ``multi_avg_fn`` or
SWA's default, grouped as torch groups them), and each averaged tensor takes the model's
value where eager copies, the average where eager averages, and its own value otherwise. The
values are eager's, bit for bit; ``n_averaged`` is a buffer of the averaged model, read and
written by the graph like any other. This is what SWA's and EMA's loops need when the update
is part of the step (torchvision's reference recipes: ``ExponentialMovingAverage``, a
subclass, updated every ``model_ema_steps`` iterations).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> ema = torch.optim.swa_utils.AveragedModel(model)
    >>> with averages_in_graph():
    ...     ema.update_parameters(model)
    >>> int(ema.n_averaged), torch.equal(ema.module.weight, model.weight)
    (1, True)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.optim import swa_utils
from torch.utils._foreach_utils import (
    _get_foreach_kernels_supported_devices,
    _group_tensors_by_device_and_dtype,
)

__all__ = ["averages_in_graph"]


@contextlib.contextmanager
def averages_in_graph() -> Iterator[None]:
    """While inside: ``AveragedModel.update_parameters`` (and its subclasses' unless they
    override it) selects between copy and average in the graph instead of on the host."""
    original = swa_utils.AveragedModel.update_parameters
    swa_utils.AveragedModel.update_parameters = _update_parameters  # type: ignore[method-assign]
    try:
        yield
    finally:
        swa_utils.AveragedModel.update_parameters = original  # type: ignore[method-assign]


@torch.no_grad()
def _update_parameters(self: swa_utils.AveragedModel, model: nn.Module) -> None:
    if self.use_buffers:
        mine = itertools.chain(self.module.parameters(), self.module.buffers())
        theirs = itertools.chain(model.parameters(), model.buffers())
    else:
        mine, theirs = self.parameters(), model.parameters()
    kept, current = [], []
    for p_averaged, p_model in zip(mine, theirs, strict=False):  # zip as torch's own
        kept.append(p_averaged.detach())
        current.append(p_model.detach().to(p_averaged.device))
    averaged = [p.clone() for p in kept]
    _average(self, averaged, current)
    for p, new, p_model in zip(kept, averaged, current, strict=True):
        n = self.n_averaged.to(p.device)
        p.copy_(torch.where(n == 0, p_model, torch.where(n > 0, new, p)))
    if not self.use_buffers:  # the buffers follow the model's, as in eager
        for b_swa, b_model in zip(self.module.buffers(), model.buffers(), strict=True):
            b_swa.detach().copy_(b_model.detach().to(b_swa.device))
    self.n_averaged += 1


def _average(self: swa_utils.AveragedModel, averaged: list[Tensor], current: list[Tensor]) -> None:
    """Torch's averaging (its ``n_averaged > 0`` branch), on ``averaged`` in place."""
    if self.multi_avg_fn is None and self.avg_fn is not None:
        for p, p_model in zip(averaged, current, strict=True):
            p.copy_(self.avg_fn(p, p_model, self.n_averaged.to(p.device)))
        return
    groups = _group_tensors_by_device_and_dtype([averaged, current])  # type: ignore[list-item]
    for (device, _), ([mine, theirs], _) in groups.items():
        n = self.n_averaged.to(device)
        if self.multi_avg_fn:
            self.multi_avg_fn(mine, theirs, n)
        elif device is not None and device.type in _get_foreach_kernels_supported_devices():
            swa_utils.get_swa_multi_avg_fn()(mine, theirs, n)
        else:
            avg_fn = swa_utils.get_swa_avg_fn()
            for p, p_model in zip(mine, theirs, strict=True):
                p.copy_(avg_fn(p, p_model, n))
