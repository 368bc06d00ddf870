"""The compiled programs of a step, one per signature family, with an account of retraces.

A call first looks for a program compiled for its exact signature (static shapes: the
common, fastest case). Failing that, for a program of its *family* (the same signature up
to sizes) traced with symbolic dimensions whose guard accepts the batch's sizes. Failing
that, the step is traced again, and :meth:`ProgramCache.plan` says which dimensions the
new trace makes symbolic:

- ``dynamic=False``: none (one static graph per distinct shape);
- ``dynamic=True``: every dimension of every batch tensor, from the first call;
- ``dynamic=None`` (automatic, as torch.compile): none on a family's first trace; then
  every dimension that has ever differed within the family. A stream of ever-changing
  sequence lengths therefore takes two traces: one static, one symbolic.

Every trace is recorded (:class:`TraceRecord`); from the third on each one is a warning
naming what changed, and ``max_traces`` bounds them (:class:`functacc.RetraceError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..errors import RetraceError
from .differences import describe_difference, leaf_difference, size_changes
from .retrace_advice import retrace_fix

__all__ = ["ProgramCache", "SizeGuard", "TraceRecord", "as_call", "warm_up"]

log = logging.getLogger("functacc")

WARN_FROM = 3  # the first two traces are expected (first call, then the symbolic one)


@dataclass
class TraceRecord:
    """One trace of the step: why it happened and what it cost."""

    number: int
    reason: str
    signature: str
    dynamic: dict[str, list[int]]
    """Input name -> dimensions traced symbolically (empty: a static graph)."""
    trace_s: float = 0.0
    compile_s: float = 0.0


class SizeGuard:
    """When a graph traced with symbolic sizes may run a batch: its static sizes match
    and its symbolic guard holds. Checked per call from the sizes alone (no device sync).

    ``fakes`` are the batch's fake inputs from the trace (sizes that stayed symbols, sizes
    specialised to 0 or 1, static sizes); ``guard`` is the ShapeEnv's guard expression
    over the inputs that have symbolic dimensions, named ``t0, t1, ...`` in order.
    """

    def __init__(
        self, fakes: Sequence[Tensor], dynamic: Sequence[Collection[int]], guard: str | None
    ):
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        self.static = [
            (i, d, int(size))
            for i, fake in enumerate(fakes)
            for d, size in enumerate(fake.shape)
            if is_concrete_int(size)
        ]
        self.symbolic_inputs = [i for i, dims in enumerate(dynamic) if dims]
        self.guard = guard
        self._check: Callable[[dict], bool] | None = None
        if guard:
            from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

            self._check = eval(f"lambda L: {guard}", dict(SYMPY_INTERP))

    def __call__(self, tensors: Sequence[Tensor]) -> bool:
        for i, d, size in self.static:
            if tensors[i].shape[d] != size:
                return False
        if self._check is None:
            return True
        return bool(self._check({f"t{k}": tensors[i] for k, i in enumerate(self.symbolic_inputs)}))


@dataclass
class _Family:
    names: list[str]
    first_shapes: list[tuple[int, ...]]
    last_shapes: list[tuple[int, ...]]
    changed: list[set[int]]
    symbolic: list[Any] = field(default_factory=list)  # programs with a SizeGuard, newest first


class ProgramCache:
    """Compiled programs keyed by signature, with the reason and cost of every trace.

    Example:
        >>> cache = ProgramCache("step", dynamic=None, max_traces=32)
        >>> cache.num_traces
        0
    """

    def __init__(self, what: str, *, dynamic: bool | None, max_traces: int | None):
        if dynamic not in (None, True, False):
            raise ValueError(f"dynamic must be None (automatic), True or False; got {dynamic!r}")
        if max_traces is not None and (not isinstance(max_traces, int) or max_traces < 1):
            raise ValueError(
                f"max_traces must be an int >= 1 or None (no limit); got {max_traces!r}"
            )
        self.what = what
        self.dynamic = dynamic
        self.static = False  # sizes stay static whatever dynamic says (recurrent layers)
        self.max_traces = max_traces
        self.records: list[TraceRecord] = []
        self._exact: dict[Hashable, Any] = {}
        self._families: dict[Hashable, _Family] = {}
        self._last_key: Hashable | None = None

    @property
    def num_traces(self) -> int:
        return len(self.records)

    def programs(self) -> list[Any]:
        """Every compiled program, oldest first."""
        symbolic = [p for f in self._families.values() for p in reversed(f.symbolic)]
        return [*self._exact.values(), *symbolic]

    # -- lookup --------------------------------------------------------------------------
    def get(self, key: Hashable) -> Any | None:
        """The program compiled for exactly this signature."""
        return self._exact.get(key)

    def holding(self, key: Hashable, holds: Callable[[Any], bool]) -> Any | None:
        """A program compiled for a signature that differs from ``key`` only in its Python
        part (a later trace read more: the other path of ``if need_update:``), whose own
        conditions hold now (``holds``); served exactly under ``key`` from now on."""
        bare = _without_python(key)
        for other, program in list(self._exact.items()):
            if _without_python(other) == bare and holds(program):
                self._exact[key] = program
                return program
        return None

    def find(self, family: Hashable, tensors: Sequence[Tensor]) -> Any | None:
        """A program of ``family`` whose guard accepts these tensors' sizes."""
        entry = self._families.get(family)
        if entry is None:
            return None
        for program in entry.symbolic:
            if program.guard(tensors):
                return program
        return None

    # -- a new trace ---------------------------------------------------------------------
    def plan(self, family: Hashable, tensors: Sequence[Tensor]) -> list[frozenset[int]]:
        """The dimensions of each batch tensor the next trace makes symbolic."""
        if self.dynamic is False:
            return [frozenset()] * len(tensors)
        if self.dynamic is True:
            return [frozenset(range(t.dim())) for t in tensors]
        entry = self._families.get(family)
        if entry is None:
            return [frozenset()] * len(tensors)
        return [
            frozenset(changed | _differing_dims(first, t.shape))
            for changed, first, t in zip(entry.changed, entry.first_shapes, tensors, strict=True)
        ]

    def reason(
        self,
        key: Hashable,
        family: Hashable,
        names: Sequence[str],
        tensors: Sequence[Tensor],
        leaf_name: Callable[[int], str] | None = None,
    ) -> str:
        """Why this signature needs a trace, naming the input and dimension that changed
        (``leaf_name(i)``: the name of the call's ``i``-th argument leaf, where known)."""
        entry = self._families.get(family)
        if entry is not None:
            shapes = [tuple(t.shape) for t in tensors]
            changes = size_changes(names, entry.last_shapes, shapes) or size_changes(
                names, entry.first_shapes, shapes
            )
            if changes:
                outside = " (outside the symbolic graph's guard)" if entry.symbolic else ""
                return ", ".join(changes) + outside
            return "sizes outside the symbolic graph's guard " + ", ".join(
                f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True)
            )
        if self._last_key is None:
            return "first call"
        # Told against the closest signature seen (the last one where as close): an update
        # step after a no-update one differs from its own kind by less than from the last.
        closest = min([self._last_key, *self._exact], key=lambda seen: _distance(seen, key))
        changed = leaf_difference(closest, key, leaf_name) if leaf_name else None
        return changed or describe_difference(closest, key)

    def check_budget(self, reason: str, signature: str) -> None:
        """Raise :class:`RetraceError` if one more trace would exceed ``max_traces``."""
        if self.max_traces is None or self.num_traces < self.max_traces:
            return
        recent = "\n".join(
            f"  trace #{r.number}: {r.reason}\n      inputs: {_shortened(r.signature)}"
            for r in self.records[-5:]
        )
        raise RetraceError(
            f"{self.what} would be traced again (trace #{self.num_traces + 1}), above "
            f"max_traces={self.max_traces}: {reason}\n  inputs: {_shortened(signature)}\n"
            f"The last traces were:\n{recent}\n{retrace_fix(reason, self.static)} Or raise "
            "the limit: max_traces=None (of jit or compile_step) means no limit. Nothing was "
            "changed by this call."
        )

    def alias(self, key: Hashable, program: Any) -> None:
        """Serve ``key`` exactly with a program compiled for another signature (not a new
        trace: nothing is recorded or counted). The next trace's reason is told against
        it, the signature seen last."""
        self._exact[key] = program
        self._last_key = key

    def add(
        self,
        key: Hashable,
        family: Hashable,
        program: Any,
        *,
        names: Sequence[str],
        tensors: Sequence[Tensor],
        record: TraceRecord,
    ) -> None:
        """Keep ``program`` (static: under ``key``; symbolic: in ``family``) and record it."""
        shapes = [tuple(t.shape) for t in tensors]
        entry = self._families.get(family)
        if entry is None:
            entry = _Family(list(names), shapes, shapes, [set() for _ in shapes])
            self._families[family] = entry
        entry.changed = [
            c | _differing_dims(first, s)
            for c, first, s in zip(entry.changed, entry.first_shapes, shapes, strict=True)
        ]
        entry.last_shapes = shapes
        if getattr(program, "guard", None) is None:
            self._exact[key] = program
        else:
            entry.symbolic.insert(0, program)
        self._last_key = key
        self.records.append(record)
        symbolic = (
            "; symbolic: " + ", ".join(f"{n} dims {d}" for n, d in record.dynamic.items())
            if record.dynamic
            else ""
        )
        message = (
            f"functacc: traced {self.what} (trace #{record.number}, {record.trace_s:.1f} s trace "
            f"+ {record.compile_s:.1f} s compile): {record.reason}{symbolic}"
        )
        if record.number >= WARN_FROM:
            log.warning("%s. %s", message, retrace_fix(record.reason, self.static))
        else:
            log.info("%s", message)


def _distance(a: Hashable, b: Hashable) -> int:
    """How many parts of two signature keys differ (keys of other shapes: 0 or 1)."""
    if not all(isinstance(k, tuple) and len(k) == 2 and type(k[1]) is tuple for k in (a, b)):
        return int(a != b)
    parts = sum(x != y for x, y in zip(a[1], b[1], strict=False))
    return (a[0] != b[0]) + parts + abs(len(a[1]) - len(b[1]))


def _without_python(key: Hashable) -> Hashable:
    """A jitted body's key (tensor specs, parts) without its ``("python", ...)`` part."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple)):
        return key
    return key[0], tuple(p for p in key[1] if not (type(p) is tuple and p[:1] == ("python",)))


def _differing_dims(a: Sequence[int], b: Sequence[int]) -> set[int]:
    return {d for d, (x, y) in enumerate(zip(a, b, strict=True)) if x != y}


def warm_up(
    cache: ProgramCache,
    batches: Iterable[Any],
    prepare: Callable[[Any], None],
    *,
    progress: bool,
) -> list[TraceRecord]:
    """Trace and compile a step for each batch (``prepare(batch)`` finds or builds its
    program, running nothing); returns the new traces. ``progress`` shows a tqdm bar."""
    from tqdm.auto import tqdm

    before = cache.num_traces
    bar = tqdm(list(batches), desc="functacc warm-up", unit="batch", disable=not progress)
    for batch in bar:
        prepare(batch)
        if cache.num_traces > before:
            last = cache.records[-1]
            bar.set_postfix_str(f"trace #{last.number}: {last.trace_s + last.compile_s:.1f} s")
    return cache.records[before:]


def as_call(batch: Any, *, with_targets: bool) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for a batch as a training loop passes it to the step: ``(inputs,
    targets)`` for a step with a loss function, else a dict, a tuple or one tensor."""
    if with_targets:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                "with a loss_fn each warm-up batch is (inputs, targets), as the step is "
                f"called; got {type(batch).__name__}"
            )
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _shortened(text: str, limit: int = 240) -> str:
    """``text`` cut to about ``limit`` characters (a batch of 64 tensors is thousands)."""
    if len(text) <= limit:
        return text
    cut = text.rfind("; ", 0, limit)
    return f"{text[: cut if cut > 0 else limit]}; ... ({text.count('; ') + 1} in all)"
