"""The front doors, over the engine (:mod:`functacc.core`).

- :func:`~functacc.compile_step`: a model, a loss and an optimizer, as one pure step
  (:mod:`.step_fn`); the stateful :class:`~functacc.Step` (:mod:`.step`) keeps the model
  and the ``torch.optim`` optimizer live (:mod:`.step_state`), keys each call
  (:mod:`.step_signature`) and finds or builds its program (:mod:`.step_programs`);
- :func:`~functacc.jit`: any step body, eager or pure;
- :func:`~functacc.accelerate` with :class:`~functacc.Config`: TorchAcc's front door.
"""
