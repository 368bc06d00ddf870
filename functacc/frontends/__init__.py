"""The front doors over the engine (:mod:`functacc.core`): :func:`~functacc.jit` for any
step body, eager or pure."""
