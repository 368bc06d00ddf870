"""An eager step body (``jit``'s imperative and pure forms) over the shared engine.

The body (forward passes, ``backward()``, ``torch.autograd.grad``, ``opt.step()``, in-place
updates under ``torch.no_grad()``) runs over the state a :class:`~.capture.Capture` lifts
into named inputs. The engine (:mod:`.engine`) traces it with ``functional=True``: first
with autograd running, so the graph holds forward, backward and update as ATen ops with
eager's kernels (dropout draws eager's masks) and the body's in-place writes; then
functionalized, so every write into an input is a ``copy_`` at the very end, after all
computation that could fail: a call that fails changes nothing.

A new signature costs a trace (fake tensors) but not always a compile: a graph identical to
one compiled already reuses it. The ``.grad`` a first call leaves costs neither where the body
clears it before reading it (``opt.zero_grad()`` first: grad_clears.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from ..backends import Backend, CudaGraphRunner, check_cuda_graphs
from ..errors import TraceError
from .body_errors import dropped_gradient_error, outside_tensor_error
from .body_trace import Exit, TracedBody, ValueGuard, known_generators
from .capture import Capture
from .diagnostics import describe_leaves, message_root, translate
from .donation import donated_positions, donated_targets, poison
from .engine import Engine, Program
from .grad_clears import reuse_without_grads
from .grad_scaler import attach_grad_scalers
from .graph_passes import (
    drop_unread_ops,
    drop_unused_inputs,
    host_scalars,
    sink_to_first_use,
    written_inputs,
)
from .graph_passes import fingerprint as graph_fingerprint
from .held_objects import check_declared_optimizers, library_objects
from .mapping_args import carried
from .python_args import NumberArguments, leaf_name
from .python_effects import build
from .python_state import PythonPlan, PythonState
from .python_tensors import owned_tensors
from .signature import (
    AmbientWatch,
    BatchWatch,
    TensorSpec,
    batch_names,
    family_key,
    kinds_key,
    positional_names,
)

__all__ = ["BodyProgram", "StepBody"]

_MAX_PYTHON_RETRACES = 16  # traces of one signature while the body's Python state is learned


@dataclass
class BodyProgram(Program):
    """A step body's program: which inputs it reads and what its outputs are."""

    used: list[int] = field(default_factory=list)  # the call's flat inputs (state, batch) read
    exit: Exit | None = None
    out_spec: pytree.TreeSpec | None = None
    out_kinds: list[Any] = field(default_factory=list)  # "tensor", ("donated", i), a constant
    n_out: int = 0  # tensor outputs of the body (the new .grad tensors follow them)
    fingerprint: tuple = ()
    donated: list[int] = field(default_factory=list)  # batch inputs whose memory is reused
    n_grads: int = 0  # the new .grad tensors (the body's Python outputs follow them)
    numbers: list[tuple[int, type]] = field(default_factory=list)  # Python outputs: numbers
    python: PythonPlan = field(default_factory=PythonPlan)  # what runs before and after
    cleared: frozenset[str] = frozenset()  # absent .grad its body cleared before any read


class StepBody:
    """Runs one step body over a :class:`Capture`, on the shared :class:`Engine`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        capture: Capture,
        *,
        backend: Backend,
        inductor_options: dict[str, Any],
        dynamic: bool | None,
        max_traces: int | None,
        donate: frozenset[int],
        what: str,
        cuda_graphs: bool | None = None,
        cuda_graph_cache_size: int = 8,
        remat: Any = None,
        background: bool = False,
    ):
        self.fn = fn
        self.remat = remat  # what backward recomputes (remat_passes.Recompute) or None
        self.capture = capture
        self.donate = donate
        # cuda_graphs None: on where the step runs on CUDA (capturable).
        self.cuda_graphs, self.cuda_graph_cache_size = cuda_graphs, cuda_graph_cache_size
        self.engine = Engine(
            what,
            backend=backend,
            holder=message_root(capture.modules, capture.labels),
            inductor_options=inductor_options,
            dynamic=dynamic,
            max_traces=max_traces,
            background=background,
        )
        self.cache = self.engine.cache
        # What the body reads and writes in Python: guarded, fed or replayed.
        owned = lambda: owned_tensors(capture.modules, capture.optimizers)  # noqa: E731
        modules = list(zip(capture.labels, capture.modules, strict=True))
        self.python = PythonState(fn, capture.optimizers, owned, modules, capture.watch.unkeyed)
        self._numbers = NumberArguments(fn, self.python.roots)  # step(x, it): guarded, fed
        self.scalers = attach_grad_scalers(capture, self.python.roots)  # step(): selects
        declared = [linked.optimizer for linked in capture.optimizers]
        check_declared_optimizers(self.python.roots, declared, capture.modules)
        self._plans: dict[Any, PythonPlan] = {}  # by graph fingerprint, as compiled
        self._value_guarded: dict[int, str] = {}  # batch tensors whose values are guarded
        self._values = ValueGuard()
        self._ambient = AmbientWatch("cuda" if torch.cuda.is_available() else "cpu")  # CPU's too
        self._state_watch, self._batch_watch = BatchWatch(), BatchWatch()
        self._last: tuple | None = None  # the last call's signature parts and program
        self.last_program: BodyProgram | None = None
        self._specs: dict[int, Any] = {}  # the batch's spec for n plain tensor arguments

    # -- a call ------------------------------------------------------------------------
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        program, state, leaves, tensors = self.program(args, kwargs)
        return self._run(program, state, leaves, tensors)

    def program(self, args: tuple, kwargs: dict) -> tuple[BodyProgram, list, list, list]:
        """The program for a call with ``args`` and ``kwargs`` (traced and compiled if new;
        nothing runs), and the state, batch leaves and batch tensors it takes."""
        self.python.new_call()
        names, state, context = self.capture.read()
        if not kwargs and all(type(a) is Tensor for a in args):  # no pytree walk
            leaves, spec = list(args), self._specs.get(len(args))
            if spec is None:
                spec = self._specs[len(args)] = pytree.tree_flatten((args, kwargs))[1]
        else:  # a UserDict's entries (a BatchEncoding batch) are leaves too
            args, kwargs = carried(args, kwargs)
            leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        donated = tuple(donated_positions(self.donate, args, leaves)) if self.donate else ()
        constants = self._numbers.bind(leaves, spec, args, kwargs)
        # What the signature is made of; each part is the same object as at the last call
        # while unchanged (the state's and the batch's specs are checked in C++), so the
        # common call compares them by identity and skips building and hashing its key.
        parts = (
            names,
            self._state_watch.key(state),
            context,
            self._ambient.key(),
            torch.is_grad_enabled(),
            spec,
            constants,
            donated,
            self._batch_watch.key(tensors),
            self.python.key(),
            self._values.key(self._value_guarded, tensors) if self._value_guarded else (),
        )
        last = self._last
        if last is not None and all(a is b or a == b for a, b in zip(parts, last[0], strict=True)):
            program = last[1]
        else:

            def keys(names: tuple = names, state_key: tuple = parts[1]) -> tuple[tuple, tuple]:
                full = (
                    ("state", names),
                    state_key,
                    context,
                    ("ambient", parts[3]),
                    ("grad mode", parts[4]),
                    ("batch", spec, constants, donated),
                    ("python", self.python.key()),
                )
                if self._value_guarded:  # batch tensors whose values a trace branched on
                    values = self._values.key(self._value_guarded, tensors)
                    full = (*full, ("batch values", values))
                return (tuple(map(TensorSpec.of, tensors)), full), (family_key(tensors), full)

            key, family = keys()
            program = self.engine.lookup(key, family, tensors, self.python.holds)
            if program is None:  # the .grad a first call left, cleared first: grad_clears.py
                find = lambda *k: self.engine.lookup(*keys(*k), tensors, self.python.holds)  # noqa: E731
                program = reuse_without_grads(names, parts[1], self.capture.dropped, find)
                if program is not None:
                    self.engine.cache.alias(key, program)
            if program is None:  # the next call looks up again: this trace found guards
                program = self._build(keys, names, state, leaves, spec, tensors, list(donated))
                self._last = None
                if self.capture.unalias():  # the run writes into the attributes' copies
                    state = self.capture.read()[1]
            else:
                self._last = (parts, program)
        return program, state, leaves, tensors

    def _run(self, program: BodyProgram, state: list, leaves: list, tensors: list) -> Any:
        self.last_program = program  # what stats() reads (set before it runs)
        replay = self.python.before_run(program.python)
        if replay.changed:  # a scheduler stepped before the graph: its new hyperparameters
            self.capture.sync_hyperparameters()
        fed = self.python.inputs(program.python, replay)
        flat = [*state, *fed, *tensors]
        try:
            outputs = self.engine.run(
                program, [flat[i] for i in program.used], lambda: describe_leaves(leaves)
            )
        except BaseException:
            replay.undo()
            if replay.changed:
                self.capture.sync_hyperparameters()
            raise
        grads_end = program.n_out + program.n_grads
        self.capture.apply_exit(program.exit, outputs[program.n_out : grads_end])
        python_outputs = list(outputs[grads_end:])
        for k, kind in program.numbers:
            python_outputs[k] = kind(python_outputs[k].item())
        replay.after(python_outputs)
        self.capture.settle()
        return self._outputs(program, outputs, tensors, fed, python_outputs, replay.lrs)

    def _outputs(
        self,
        program: BodyProgram,
        outputs: Sequence[Tensor],
        tensors: list[Tensor],
        fed: list[Any],
        python_outputs: Sequence[Any],
        lrs: dict,
    ) -> Any:
        produced = iter(outputs[: program.n_out])
        leaves = []
        for kind in program.out_kinds:
            if kind == "tensor":
                leaves.append(next(produced))
            elif kind[0] == "donated":
                leaves.append(tensors[kind[1]].detach())  # a new handle on the reused memory
            elif kind[0] == "fed":  # a tensor of the Python state, updated in place
                leaves.append(fed[kind[1]])
            elif kind[0] == "python":  # a number the graph computed, or a scheduler's lr
                leaves.append(build(kind[1], python_outputs, lrs))
            else:
                leaves.append(kind[1])
        for i in program.donated:
            poison(tensors[i])
        return pytree.tree_unflatten(leaves, program.out_spec)

    # -- tracing -----------------------------------------------------------------------
    def _build(
        self,
        keys: Callable[[], tuple[tuple, tuple]],
        names: list[str],
        state: list[Tensor],
        leaves: list,
        spec: Any,
        tensors: list[Tensor],
        donated: list[int],
    ) -> BodyProgram:
        key, family = keys()
        call = pytree.tree_unflatten(leaves, spec)  # (args, kwargs)
        names_of = batch_names(*call, positional_names(self.fn))
        named = partial(leaf_name, self.fn, *call)  # an argument leaf's name, for reasons
        plan = self.engine.plan(key, family, names_of, tensors, describe_leaves(leaves), named)
        stand_ins = self.capture.stand_ins(names, state)
        # Counters the body writes are fed from the first trace, numbers it branches on are
        # guarded: each discovery traces again (fake tensors, cheap), never compiles twice.
        # The objects the body holds (a GradScaler) are left as they were by every trace.
        held = library_objects(self.python.roots, [x for x in leaves if not _is_t(x)])
        for _ in range(_MAX_PYTHON_RETRACES):
            fed = self.python.prepare()
            example = [*state, *self.python.inputs(), *tensors]
            for i in stand_ins:  # ZeRO-2's missing gradients: a tensor of their own to trace
                example[i] = torch.empty_like(state[i])
            body = TracedBody(self, names, len(state), fed, leaves, spec, donated)
            known = known_generators(self.capture.modules, self.python.roots)
            try:
                traced = self.engine.trace(
                    body,
                    example,
                    plan,
                    n_fixed=len(state) + len(fed),
                    functional=True,
                    strict=True,
                    on_error=lambda exc: self._trace_error(exc, plan.signature),
                )
            except Exception as exc:
                held.restore()
                if self.python.retry(exc):
                    continue
                raise
            break
        else:
            raise TraceError(f"{self.engine.cache.what}: {self.python.unsettled()}")
        held.refuse_left_behind()  # a library's meter that kept a symbol of the trace
        if self.remat is not None:
            self.remat.rewrite(traced.graph, batch_inputs=len(tensors))
        python = self.python.finish(body.recorder, fed, traced.number_guard, traced.branch_sites)
        self._value_guarded |= body.value_guarded
        self.python.generator_resets(python, traced.graph, known)
        plan.key, plan.family = keys()  # with the guards this trace found
        drop_unread_ops(traced.graph)
        if self.capture.rest is not None:  # ZeRO-3: each unit gathered where first read
            sink_to_first_use(traced.graph, [i for i, n in enumerate(names) if n[:6] == "shard "])
        used = drop_unused_inputs(traced.graph)
        read = [names[i].removeprefix("grad ") for i in stand_ins if i in used]
        if read:
            raise dropped_gradient_error(self.engine.cache.what, read)
        n_fixed = len(state) + len(fed)
        input_names = [*names, *(f"python {loc.label}" for loc in fed)]
        outputs = (body.exit.signature(), body.out_spec, kinds_key(body.kinds))
        fingerprint = graph_fingerprint(
            traced.graph,
            [(input_names[i] if i < n_fixed else f"batch {i - n_fixed}") for i in used],
            [
                TensorSpec.of(e) if _is_t(e) else type(e).__name__
                for e in (example[i] for i in used)
            ],
            # Factory ops traced without a dtype take the default one (Inductor bakes it in).
            (*outputs, python.signature(), torch.get_default_dtype()),
        )
        program = BodyProgram(
            run=None,  # type: ignore[arg-type]  # set below
            graph=traced.graph,
            used=used,
            exit=body.exit,
            out_spec=body.out_spec,
            out_kinds=body.kinds,
            n_out=body.n_out,
            fingerprint=fingerprint,
            donated=donated_targets(body.kinds),
            n_grads=body.n_grads,
            numbers=body.numbers,
            python=python,
            cleared=body.cleared,
        )
        symbolic = traced.fakes is not None
        capture_graphs = self._captures(plan.devices)
        numbers = body.numbers or any(not _is_t(loc.get()) for loc in python.fed)
        if capture_graphs and (numbers or host_scalars(traced.graph)):
            # Python numbers in or out (a counter, loss.item()) are host memory that a
            # replay would not read or write: such a graph runs uncaptured.
            if self.cuda_graphs:
                raise ValueError(
                    "cuda_graphs=True, but this step's graph takes or returns Python numbers "
                    "(a counter it writes, a .item() it returns), which a CUDA graph replay "
                    "would not update. Leave cuda_graphs=None (such a step runs uncaptured)."
                )
            capture_graphs = False
        reuse = None if symbolic else self.engine.compiled(fingerprint)
        if reuse is not None:
            python.rebind(self._plans[fingerprint])  # the generators the compiled graph holds
            program.run = reuse
            self.engine.alias(plan, program)
        else:
            self.engine.check_budget(plan)
            program.run = self.engine.compile(traced, example, used=used, fingerprint=fingerprint)
            self.engine.keep(plan, program, traced, n_fixed=n_fixed)
            self._plans[fingerprint] = python
        if capture_graphs:
            # The state's addresses are baked into a capture (a .grad the body replaces
            # every call is captured again); the batch is copied in, and a donated
            # argument's new value copied back out.
            program.run = CudaGraphRunner(
                program.run,
                sum(i < len(state) for i in used),
                written=written_inputs(program.graph),
                cache_size=self.cuda_graph_cache_size,
            )
        return program

    def _captures(self, devices: frozenset[torch.device]) -> bool:
        """Whether this program is a CUDA graph (``cuda_graphs``, devices, collectives)."""
        if not devices and not self.cuda_graphs:
            return False
        device = min(devices, key=str) if devices else torch.device("cpu")
        ranks = dist.is_initialized() and dist.get_world_size() > 1
        collectives = dist.get_backend_config() if ranks else None
        return check_cuda_graphs(self.cuda_graphs, device, collectives)

    def _trace_error(self, exc: Exception, described: str) -> Exception:
        error = outside_tensor_error(exc, self.python.roots, self.capture)
        jit = self.capture.door == "functacc.jit"  # else compile_step's standard body
        call = f"{getattr(self.fn, '__qualname__', 'fn')}(...) run eagerly" if jit else None
        return error or translate(exc, self.engine.holder, described, call)


def _is_t(x: Any) -> bool:
    return isinstance(x, Tensor)
