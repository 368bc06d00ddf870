"""The engine every front door runs on: trace -> transform -> compile -> run, per signature.

A front door (:func:`functacc.compile_step`, :func:`functacc.jit`) turns its step into a
flat function of tensors (state, then batch) and a signature key; the engine does the rest:

1. **lookup**: a program compiled for exactly this signature, or a graph with symbolic
   sizes whose guard accepts the batch (:class:`~functacc.core.cache.ProgramCache`);
2. **plan**: why a new trace is needed (named in the record and in the retrace warning)
   and which dimensions it makes symbolic (``dynamic``);
3. **trace**: :func:`functacc.core.tracer.trace`, one tracer for both front doors;
4. **compile**: Inductor or the FX interpreter (:func:`functacc.compile.compile_graph`),
   after the front door's graph transforms; a graph identical to one compiled already
   reuses it;
5. **run**: no autograd around the graph (it writes into tensors that require grad); a run
   that fails after drawing random numbers puts the generators back, and its error names
   the inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule

from ..backends import Backend, Compiled, check_generators, compile_graph
from ..backends.background import BackgroundCompiled
from . import tracer
from .cache import WARN_FROM, ProgramCache, SizeGuard, TraceRecord, log
from .diagnostics import run_error
from .graph_passes import host_scalars
from .recurrent import static_sizes
from .retrace_advice import branch_fix

__all__ = ["Engine", "Plan", "Program", "draws_random", "rng_state", "set_rng_state"]

_set_grad_enabled = torch._C._set_grad_enabled


@dataclass
class Program:
    """One traced and compiled step, for one signature (front doors add their own fields)."""

    run: Compiled
    graph: GraphModule
    guard: SizeGuard | None = None  # graphs with symbolic sizes: which sizes they accept
    random: bool = False  # draws random numbers (dropout): a failed run restores the RNG
    devices: frozenset[torch.device] = field(default_factory=frozenset)  # GPUs it runs on


@dataclass
class Plan:
    """What a new trace is for: its key, why it happens, what it makes symbolic."""

    key: Hashable
    family: Hashable
    names: list[str]  # the batch tensors' names, for records and retrace messages
    tensors: list[Tensor]  # the batch tensors
    signature: str  # the batch, described for error messages
    reason: str
    dynamic: list[frozenset[int]]  # per batch tensor: the dimensions traced symbolically
    started: float = field(default_factory=time.perf_counter)
    traced_at: float = 0.0
    devices: frozenset[torch.device] = frozenset()  # the GPUs its inputs are on

    @property
    def symbolic(self) -> bool:
        return any(self.dynamic)


class Engine:
    """Traces, compiles, keeps and runs the programs of one step.

    Example:
        >>> import torch
        >>> from functacc.core.engine import Engine
        >>> engine = Engine("a step", backend="eager", holder=torch.nn.Module())
        >>> x = torch.randn(3)
        >>> plan = engine.plan(("x", 3), ("x",), ["x"], [x], "x: (3,) float32")
        >>> traced = engine.trace(lambda x: (x * 2,), [x], plan, n_fixed=0)
        >>> program = Program(engine.compile(traced, [x]), traced.graph)
        >>> engine.keep(plan, program, traced, n_fixed=0)
        >>> torch.equal(engine.run(program, [x], lambda: "x")[0], x * 2), engine.num_traces
        (True, 1)
    """

    def __init__(
        self,
        what: str,
        *,
        backend: Backend,
        holder: nn.Module,
        inductor_options: dict[str, Any] | None = None,
        dynamic: bool | None = None,
        max_traces: int | None = 32,
        background: bool = False,
    ):
        self.read_values = False  # traces read known batch values (host_values.py)
        self.backend = backend
        self.background = background  # Inductor compiles in a worker meanwhile (background.py)
        self._pending: list[BackgroundCompiled] = []
        self.holder = holder  # the modules the step runs, for error messages and checks
        self.inductor_options = inductor_options or {}
        self.cache = ProgramCache(what, dynamic=dynamic, max_traces=max_traces)
        # Recurrent layers run eager's kernels only with static sizes (core/recurrent.py).
        self.static = static_sizes(holder, dynamic)
        self.cache.static = self.static  # its advice on retraces leaves out dynamic=True
        self.reused = 0  # signatures served by a graph compiled for another one
        self._by_fingerprint: dict[Hashable, Compiled] = {}

    @property
    def num_traces(self) -> int:
        return self.cache.num_traces

    def wait_for_compile(self) -> float:
        """Finish the compiles running in the background (``background=True``): wait for
        them and use the compiled code from the next call on; returns the seconds waited."""
        waited = 0.0
        while self._pending:  # one that fails to compile leaves the others pending
            waited += self._pending.pop(0).finish()
        return waited

    # -- 1. lookup ------------------------------------------------------------------------
    def lookup(
        self,
        key: Hashable,
        family: Hashable,
        tensors: Sequence[Tensor],
        holds: Callable[[Any], bool] | None = None,
    ) -> Any | None:
        """The program for this signature, or one whose symbolic sizes accept the batch, or
        (given ``holds``) one whose own Python conditions hold though the signature's
        Python part is new."""
        program = self.cache.get(key)
        if program is None and holds is not None:
            program = self.cache.holding(key, holds)
        return program if program is not None else self.cache.find(family, tensors)

    # -- 2. plan --------------------------------------------------------------------------
    def plan(
        self,
        key: Hashable,
        family: Hashable,
        names: list[str],
        tensors: list[Tensor],
        signature: str,
        leaf_name: Callable[[int], str] | None = None,
    ) -> Plan:
        reason = self.cache.reason(key, family, names, tensors, leaf_name)
        dynamic = self.cache.plan(family, tensors)
        if self.static:
            dynamic = [frozenset()] * len(dynamic)
        return Plan(key, family, names, tensors, signature, reason, dynamic)

    def check_budget(self, plan: Plan) -> None:
        """Refuse the trace that would pass ``max_traces`` (:class:`functacc.RetraceError`)."""
        self.cache.check_budget(plan.reason, plan.signature)

    # -- 3. trace -------------------------------------------------------------------------
    def trace(
        self, fn: Callable[..., Any], example: list[Tensor], plan: Plan, *, n_fixed: int, **options
    ) -> tracer.Traced:
        """Trace ``fn(*example)``: ``n_fixed`` state inputs, then the batch tensors;
        ``options`` go to :func:`functacc.core.tracer.trace`."""
        dims: list[Collection[int]] = [*[()] * n_fixed, *plan.dynamic]
        traced = tracer.trace(
            fn,
            example,
            holder=self.holder,
            signature=plan.signature,
            dynamic=dims if plan.symbolic else None,
            read_values=self.read_values,
            **options,
        )
        # A step that needed its batch's values read (host_values.py) reads them in every
        # later trace at once, instead of failing a first trace each time.
        self.read_values = traced.read_values
        plan.traced_at = time.perf_counter()
        plan.devices = frozenset(t.device for t in example if isinstance(t, Tensor) and t.is_cuda)
        return traced

    # -- 4. compile -----------------------------------------------------------------------
    def compiled(self, fingerprint: Hashable) -> Compiled | None:
        """The compile of a static graph identical to this one (its code, the named inputs
        it reads, its outputs and write-backs), if there is one: a new signature that
        traces to the same graph costs no compile."""
        return self._by_fingerprint.get(fingerprint)

    def compile(
        self,
        traced: tracer.Traced,
        example: Sequence[Tensor],
        *,
        used: Sequence[int] | None = None,
        fingerprint: Hashable | None = None,
    ) -> Compiled:
        """Compile the traced graph (after the front door's transforms) over ``example``,
        or over the inputs at ``used`` where the graph reads only those."""
        fakes = traced.fakes
        numbers = any(not isinstance(t, Tensor) for t in example)
        if fakes is None and (numbers or host_scalars(traced.graph)):
            # Python numbers (inputs, or read from tensors) are symbols of the trace's fake
            # mode: the graph compiles in it, from the fakes it was traced with.
            fakes = list(traced.example_fakes)
        if used is not None:
            example = [example[i] for i in used]
            fakes = None if fakes is None else [fakes[i] for i in used]
        check_generators(traced.graph, self.backend, self.holder)
        run = compile_graph(
            traced.graph,
            example,
            self.backend,
            fakes=fakes,
            options=self.inductor_options,
            background=self.background,
        )
        if isinstance(run, BackgroundCompiled):
            self._pending.append(run)
        if fingerprint is not None and traced.fakes is None:
            self._by_fingerprint[fingerprint] = run
        return run

    def keep(self, plan: Plan, program: Program, traced: tracer.Traced, *, n_fixed: int) -> None:
        """Keep ``program`` in the cache for ``plan``'s signature and record the trace: why
        it happened, which dimensions it made symbolic, what it cost."""
        program.random = draws_random(program.graph)
        program.devices = plan.devices
        dims: dict[str, list[int]] = {}
        if traced.fakes is not None:
            program.guard = SizeGuard(traced.fakes[n_fixed:], plan.dynamic, traced.guard)
            fixed = {(i, d) for i, d, _ in program.guard.static}
            for i, ds in enumerate(plan.dynamic):
                kept = sorted(d for d in ds if (i, d) not in fixed)
                if kept:
                    dims[plan.names[i]] = kept
        record = TraceRecord(
            number=self.cache.num_traces + 1,
            reason=f"{plan.reason} ({traced.fixed})"
            if getattr(traced, "fixed", "")
            else plan.reason,
            signature=plan.signature,
            dynamic=dims,
            trace_s=plan.traced_at - plan.started,
            compile_s=time.perf_counter() - plan.traced_at,
        )
        self.cache.add(
            plan.key, plan.family, program, names=plan.names, tensors=plan.tensors, record=record
        )

    def alias(self, plan: Plan, program: Program) -> None:
        """Serve ``plan``'s exact signature with a program whose compile was reused: not a
        new trace in the account (nothing was compiled), but said: a trace per call with
        identical graphs is host time lost on every call (a value baked in that changes)."""
        program.random = draws_random(program.graph)
        program.devices = plan.devices
        self.cache.alias(plan.key, program)
        self.reused += 1
        message = (
            f"functacc: traced {self.cache.what} again ({time.perf_counter() - plan.started:.1f}"
            f" s, the graph of an earlier trace: no compile): {plan.reason}"
        )
        if self.reused >= WARN_FROM and "branch on fed numbers" in plan.reason:
            log.warning("%s. %s", message, branch_fix(plan.reason))
        elif self.reused >= WARN_FROM:
            log.warning(
                "%s. %d traces so far gave a graph traced before: what changed is part of "
                "the signature but not of the graph, and each new value costs a trace (host "
                "time in that call). Keep it constant, or out of the step (a number argument "
                "is fed once it changes, with no trace per value).",
                message,
                self.reused,
            )
        else:
            log.info("%s", message)

    # -- 5. run ---------------------------------------------------------------------------
    def run(self, program: Program, inputs: list[Tensor], describe: Callable[[], str]) -> Any:
        """Run ``program``. A failure leaves the state as it was (the graph writes only at
        its end) and the random generators too; ``describe()`` names the inputs."""
        rng = rng_state(program.devices) if program.random else None
        grad_mode = torch.is_grad_enabled()
        # The graph writes into tensors that require grad: run it without autograd.
        # Switching the mode directly costs a tenth of torch.no_grad().
        _set_grad_enabled(False)
        try:
            return program.run(inputs)
        except Exception as exc:
            if rng is not None:  # the graph may have drawn random numbers before it failed
                set_rng_state(rng)
            raise run_error(exc, describe()) from exc
        finally:
            _set_grad_enabled(grad_mode)


def draws_random(gm: GraphModule) -> bool:
    """Whether the graph draws random numbers (dropout, ``torch.rand``): a call that fails
    after drawing must put the generators back."""
    seeded = torch.Tag.nondeterministic_seeded
    return any(seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes)


def rng_state(devices: Collection[torch.device]) -> tuple[Tensor, dict[torch.device, Tensor]]:
    """The CPU generator's state and that of each of ``devices`` that is a GPU."""
    cuda = {d for d in devices if d.type == "cuda"}
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in cuda}


def set_rng_state(state: tuple[Tensor, dict[torch.device, Tensor]]) -> None:
    """Put back what :func:`rng_state` read."""
    torch.set_rng_state(state[0])
    for device, cuda in state[1].items():
        torch.cuda.set_rng_state(cuda, device)
