"""Compile in the background: the first steps run the traced graph while a worker compiles.

With ``background_compile=True`` (``compile_step`` and ``jit``), a new graph is not compiled
before its first step. A worker process (:func:`~.compile_worker.spawn`) compiles it into
Inductor's on-disk cache while this process runs the steps with the graph as traced, op by
op with PyTorch's kernels (what ``backend="eager"`` runs). At the first call after the
worker has finished, this process loads the compiled code from the cache (about a second)
and runs it from then on. The first step then costs a trace and one step at eager speed
instead of a compile; the steps until the swap run at about eager speed, and on a machine
with few cores the worker's compile takes the cores they would use.

What a user sees change at the swap: the numbers of a fused kernel instead of PyTorch's
(float rounding, as between ``backend="eager"`` and ``"inductor"``), at a step that depends
on how fast the worker compiled. A run that must repeat bit for bit leaves this off or calls
:meth:`BackgroundCompiled.finish` (``step.wait_for_compile()``) at a fixed step.

A worker that fails costs time, never correctness: the swap then compiles the graph in this
process, as without background compiles, and a compile error is raised by that step (before
it runs: the step leaves the model and optimizer as they were).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch import Tensor

from .compile_worker import CompileWorker

__all__ = ["BackgroundCompiled", "busy"]

log = logging.getLogger("functacc")


# Background compiles not yet in use, in this process. One at a time: each worker imports
# torch and holds a compile's memory (a GB or more on a large step), and a warm-up over many
# bucket shapes would start a pair per shape; a graph traced while one is running compiles
# before its first call instead.
_pending: set[BackgroundCompiled] = set()


def busy() -> bool:
    """Whether a background compile is running in this process."""
    for run in list(_pending):
        if not run.running:  # finished, not yet swapped in: no longer holds a worker
            _pending.discard(run)
    return bool(_pending)


class BackgroundCompiled:
    """A step's graph, run as traced until a worker's compile is ready, then compiled.

    Called as a :data:`~functacc.backends.compile.Compiled` (one list of tensors).
    ``first``: the graph as traced; ``compile_here``: compiles the graph in this process
    (cache hits once the workers have finished); ``workers``: the processes compiling it
    (one per graph of the step: a large update compiles beside forward and backward).
    """

    def __init__(
        self,
        first: Callable[[list[Tensor]], Any],
        compile_here: Callable[[], Callable[[list[Tensor]], Any]],
        workers: list[CompileWorker],
    ):
        self._run = first
        self._compile_here = compile_here
        self._workers = workers
        _pending.add(self)
        self._started = time.perf_counter()
        self.steps_before = 0  # steps run as traced, before the compiled code
        self.ready_after_s: float | None = None  # from the worker's start to the swap

    @property
    def pending(self) -> bool:
        """Whether the compiled code is not yet in use."""
        return bool(self._workers)

    @property
    def running(self) -> bool:
        """Whether a worker is still compiling."""
        return any(not w.done for w in self._workers)

    def __call__(self, args: list[Tensor]) -> Any:
        if self._workers:
            if all(w.done for w in self._workers):  # a waitpid each: microseconds
                self.finish()
            else:
                self.steps_before += 1
        return self._run(args)

    def finish(self) -> float:
        """Wait for the worker, then load the compiled code (or compile it here, if the
        worker failed) and use it for every later call; returns the seconds this took."""
        workers, self._workers = self._workers, []
        _pending.discard(self)
        if not workers:
            return 0.0
        start = time.perf_counter()
        if not all([w.finish(wait=True) for w in workers]):
            log.debug("background compile failed in a worker: compiling in this process")
        try:
            self._run = self._compile_here()
        except BaseException:
            # The error is the compile's, raised before the step runs; later calls go on
            # with the graph as traced rather than raise it again every step.
            self.ready_after_s = float("nan")
            raise
        self.ready_after_s = time.perf_counter() - self._started
        waited = time.perf_counter() - start
        log.debug(
            "background compile in use after %.1f s and %d steps (%.1f s to load)",
            self.ready_after_s,
            self.steps_before,
            waited,
        )
        return waited

    def stop(self) -> None:
        """Stop the worker and go on with the graph as traced (this process is ending)."""
        workers, self._workers = self._workers, []
        _pending.discard(self)
        for worker in workers:
            worker.stop()
