"""Inductor's checks of a graph's input sizes and strides, made in one call at the start.

The Python code Inductor generates checks that every input it reads has the sizes and
strides the graph was compiled for (``size_asserts``, on by default). Since torch 2.12 or
2.13 (2.11 checks every input at the start, one call each) it places each check just before
the first kernel that reads the input, so that on a GPU the first kernel starts sooner; it
groups the inputs of one kernel into one call. A training
step's update graph reads every parameter, gradient and optimizer state tensor, one group
per parameter, and the forward reads each layer's weights just before its matmul: the
bench MLP's two graphs made 59 check calls per step (0.3-0.5 us each on this 2-core CPU,
more with the cold caches a step starts with).

:func:`input_checks_first` makes Inductor write one grouped call instead, before the
first kernel, for every input that a kernel of the graph reads: the same inputs are checked
against the same sizes, and a wrong one fails before any kernel has run. (Inductor applies a
graph's writes to its inputs at its end, so that was already true of them.) The rest of the
generated code is unchanged. Measured per graph on the bench MLP with
``benchmarks/experiments/step_breakdown.py``-style timers: the update graph 203-206 us instead of
210-215 us, the gradients graph unchanged within noise. It patches a private
method of Inductor's wrapper code generator while a graph compiles; where that method is
missing (torch 2.11, see ``_compat.inductor_defers_input_checks``), it does nothing and
Inductor's own placement stays: every check before the first kernel, one call per input.

Example:
    >>> with input_checks_first():
    ...     pass  # compile_fx(...) here writes its input checks first
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from ... import _compat

__all__ = ["input_checks_first"]


@contextlib.contextmanager
def input_checks_first() -> Iterator[None]:
    """While active, Inductor's generated code checks every input a kernel reads in one
    call, before the first kernel."""
    if not _compat.inductor_defers_input_checks():
        yield
        return
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.virtualized import V

    deferred = PythonWrapperCodegen.codegen_deferred_input_asserts

    def all_at_first_use(self: Any, input_names: Iterable[str]) -> None:
        pending = getattr(self, "_pending_input_asserts", None)
        scheduler = getattr(V.graph, "scheduler", None)
        if not pending or scheduler is None:
            return deferred(self, input_names)
        # Once per graph: the inputs no kernel reads leave the pending checks (Inductor never
        # writes those either), so that later calls find nothing pending and cost nothing.
        read = {dep.name for node in scheduler.nodes for dep in node.read_writes.reads}
        for name in [name for name in pending if name not in read]:
            del pending[name]
        return deferred(self, list(pending))

    PythonWrapperCodegen.codegen_deferred_input_asserts = all_at_first_use
    try:
        yield
    finally:
        PythonWrapperCodegen.codegen_deferred_input_asserts = deferred
