"""Pure optimizers for functacc: ``GradientTransformation(init, update)`` and friends.

The named optimizers compute exactly what ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` compute,
as pure tensor math, so they can be traced into the training graph.

Example:
    >>> import torch, functacc
    >>> opt = functacc.optim.chain(
    ...     functacc.optim.clip_by_global_norm(1.0),
    ...     functacc.optim.adamw(functacc.optim.cosine_decay(1e-3, 1000)),
    ... )
"""

from ._adam import AdamState, adam, adamw
from ._as_torch import TransformOptimizer, as_optimizer
from ._clip import clip_by_global_norm, global_norm
from ._partition import partition
from ._schedules import constant, cosine_decay, linear_warmup
from ._sgd import SGDState, sgd
from ._torch import from_torch
from ._transform import GradientTransformation, Schedule, apply_updates, chain, identity

__all__ = [
    "AdamState",
    "GradientTransformation",
    "SGDState",
    "Schedule",
    "TransformOptimizer",
    "adam",
    "adamw",
    "apply_updates",
    "as_optimizer",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "from_torch",
    "global_norm",
    "identity",
    "linear_warmup",
    "partition",
    "sgd",
]
