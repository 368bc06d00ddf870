"""The optimizers ``python -m functacc bench --optimizer NAME`` trains with.

Every competitor builds its own optimizer of the chosen kind over its own copy of the model;
without ``--optimizer`` a workload keeps its own (AdamW, or SGD for the ResNets). Names
without a twin in :mod:`functacc.optim` run through their own traced ``step()``
(``compile_step`` on ``jit``'s pipeline, :mod:`functacc.frontends.step`).

Example:
    >>> import torch
    >>> make = OPTIMIZERS["rmsprop"]
    >>> type(make(torch.nn.Linear(2, 2))).__name__
    'RMSprop'
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["OPTIMIZERS"]


def _timm(name: str, **options: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        import timm.optim  # a bench extra (the dev extra has it)

        return getattr(timm.optim, name)(model.parameters(), **options)

    return make


class AdamWOwnStep(torch.optim.AdamW):
    """AdamW run through its own traced ``step()``, not functacc's twin: to measure one
    against the other (a subclass has no twin)."""


O = torch.optim  # noqa: E741
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: O.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4),
    "adam": lambda m: O.Adam(m.parameters(), lr=1e-3),
    "adamw": lambda m: O.AdamW(m.parameters(), lr=1e-3),
    "adamw-own-step": lambda m: AdamWOwnStep(m.parameters(), lr=1e-3),
    "rmsprop": lambda m: O.RMSprop(m.parameters(), lr=1e-3, momentum=0.9),
    "adagrad": lambda m: O.Adagrad(m.parameters(), lr=1e-2),
    "nadam": lambda m: O.NAdam(m.parameters(), lr=1e-3),
    "radam": lambda m: O.RAdam(m.parameters(), lr=1e-3),
    "adafactor": lambda m: O.Adafactor(m.parameters(), lr=1e-2),
    "lion": _timm("Lion", lr=1e-4, weight_decay=0.01),
    "lamb": _timm("Lamb", lr=1e-3, weight_decay=0.01),
}
