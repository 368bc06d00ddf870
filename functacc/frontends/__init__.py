"""The front doors, over the engine (:mod:`functacc.core`).

- :func:`~functacc.compile_step`: a model, a loss and an optimizer; :class:`~functacc.Step`
  (:mod:`.step`) is the standard training step written as an eager body and compiled by
  ``jit`` (checks and micro-batches in :mod:`.step_fn`, the pure form in :mod:`.body_pure`);
- :func:`~functacc.jit`: any step body, eager or pure;
- :func:`~functacc.accelerate` with :class:`~functacc.Config`: TorchAcc's front door.
"""
