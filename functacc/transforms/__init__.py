"""Transforms of the pure training step that are neither parallelism nor the optimizer.

- :mod:`.precision`: mixed precision (autocast compute, float32 master weights, dynamic
  loss scaling as part of the state);
- :mod:`.remat`: activation recomputation of chosen modules, with dropout drawing the same
  masks in the recomputation.

Parallelism (:mod:`functacc.parallel`) and optimizers (:mod:`functacc.optim`) are
transforms too; they have their own packages.
"""

from .precision import Precision, resolve_precision
from .remat import POLICIES, RematPolicy

__all__ = ["POLICIES", "Precision", "RematPolicy", "resolve_precision"]
