"""Trace an eager step body once per signature into one functional graph, compile, run.

The body (forward passes, ``backward()``, ``torch.autograd.grad``, ``opt.step()``, in-place
updates under ``torch.no_grad()``) is traced in two passes over fake tensors:

1. ``make_fx`` of the body over the captured state (:mod:`.capture`): autograd runs while
   tracing, so the graph holds forward, backward and update as ATen ops, with eager's
   kernels (dropout draws eager's masks) and with the body's in-place writes;
2. ``make_fx`` of ``torch.func.functionalize`` of that graph: every write into an input
   becomes a ``copy_`` at the very end, after all computation that could fail, so a call
   that fails changes nothing, and Inductor sees a functional graph.

A new signature costs a trace (fake tensors, cheap) but not always a compile: a graph
identical to one compiled already (the same code over the same named inputs, the same
write-backs) reuses it. The usual step body starts with ``opt.zero_grad()``: its first
call comes with no ``.grad`` and its second with one, which the body discards; both
trace to the same graph, compiled once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from ..backends import Backend, Compiled, check_generators, compile_graph
from ..cache import ProgramCache, SizeGuard, TraceRecord
from ..errors import TraceError
from ..signature import AmbientWatch, TensorSpec, family_key, hashable_constant
from ..trace import (
    _AttributeWatch,
    _eager_dropout,
    _HeldRandomWatch,
    _HostRandomWatch,
    _quiet_fake_tensor_log,
    _symbolic_fakes,
    _translate,
    describe_tensor,
    draws_random,
    rng_state,
    run_error,
    set_rng_state,
)
from .capture import Capture, Exit
from .donation import donated_positions, donated_targets, donation_target, poison
from .graph_passes import (
    bernoulli_in_place,
    direct_writes,
    drop_unused_inputs,
)
from .graph_passes import fingerprint as graph_fingerprint
from .side_effects import OuterStateWatch

__all__ = ["Engine", "Program"]

_set_grad_enabled = torch._C._set_grad_enabled


@dataclass
class Program:
    """One traced and compiled step body, for one signature."""

    run: Compiled
    graph: GraphModule
    used: list[int]  # which of the call's flat inputs (state, then batch) the graph reads
    exit: Exit
    out_spec: pytree.TreeSpec
    out_kinds: list[Any]  # per output leaf: "tensor", ("donated", batch input), or a constant
    n_out: int  # tensor outputs of the body (the new .grad tensors follow them)
    fingerprint: tuple = ()
    guard: SizeGuard | None = None
    random: bool = False
    donated: list[int] = field(default_factory=list)  # batch inputs whose memory is reused


class Engine:
    """Traces, compiles and runs one step body over a :class:`Capture`."""

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
    ):
        self.fn = fn
        self.capture = capture
        self.backend = backend
        self.inductor_options = inductor_options
        self.donate = donate
        self.cache = ProgramCache(what, dynamic=dynamic, max_traces=max_traces)
        self.reused = 0  # signatures served by a graph compiled for another one
        self._by_fingerprint: dict[tuple, Program] = {}
        # Autocast on the CPU and, where there is one, the GPU: a body may run on either.
        self._ambient = AmbientWatch("cuda" if torch.cuda.is_available() else "cpu")
        self._holder = _holder(capture)
        self._last_state: list[Tensor | None] = []
        self._last_specs: list[TensorSpec | None] = []

    # -- a call ------------------------------------------------------------------------
    def __call__(self, args: tuple, kwargs: dict) -> Any:
        names, state, context = self.capture.read()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        donated = donated_positions(self.donate, args, leaves)
        constants = tuple(
            hashable_constant(x) if not isinstance(x, Tensor) else None for x in leaves
        )
        context = (
            tuple(names),
            self._state_specs(names, state),
            context,
            ("ambient", self._ambient.key()),
            ("grad mode", torch.is_grad_enabled()),
            ("batch", spec, constants, tuple(donated)),
        )
        key = (tuple(map(TensorSpec.of, tensors)), context)
        program = self.cache.get(key)
        if program is None:
            family = (family_key(tensors), context)
            program = self.cache.find(family, tensors)
            if program is None:
                program = self._build(key, family, names, state, leaves, spec, tensors, donated)
        flat = [*state, *tensors]
        inputs = [flat[i] for i in program.used]
        rng = rng_state({t.device for t in flat if t.is_cuda}) if program.random else None
        grad_mode = torch.is_grad_enabled()
        _set_grad_enabled(False)  # the graph writes into tensors that require grad
        try:
            outputs = program.run(inputs)
        except Exception as exc:
            if rng is not None:  # the graph may have drawn random numbers before it failed
                set_rng_state(rng)
            raise run_error(exc, _describe(leaves)) from exc
        finally:
            _set_grad_enabled(grad_mode)
        self.capture.apply_exit(program.exit, outputs[program.n_out :])
        return self._outputs(program, outputs, tensors)

    def _state_specs(self, names: list[str], state: list[Tensor]) -> tuple:
        """The state tensors' specs; those of the tensors that persist across calls
        (parameters, buffers, optimizer state: the same objects every call) are reused."""
        last, specs = self._last_state, self._last_specs
        if len(last) != len(state):
            last, specs = [None] * len(state), [None] * len(state)
        new_specs = [
            s if t is old else TensorSpec.of(t)
            for t, old, s in zip(state, last, specs, strict=True)
        ]
        # Gradients come and go (zero_grad): not held past the call, so that eager's memory
        # high point is not raised by keeping the last ones alive.
        self._last_state = [
            None if n.startswith("grad ") else t for n, t in zip(names, state, strict=True)
        ]
        self._last_specs = new_specs
        return tuple(new_specs)

    def _outputs(self, program: Program, outputs: Sequence[Tensor], tensors: list[Tensor]) -> Any:
        produced = iter(outputs[: program.n_out])
        leaves = []
        for kind in program.out_kinds:
            if kind == "tensor":
                leaves.append(next(produced))
            elif isinstance(kind, tuple) and kind[0] == "donated":
                leaves.append(tensors[kind[1]].detach())  # a new handle on the reused memory
            else:
                leaves.append(kind[1])
        for i in program.donated:
            poison(tensors[i])
        return pytree.tree_unflatten(leaves, program.out_spec)

    # -- tracing -----------------------------------------------------------------------
    def _build(
        self,
        key: tuple,
        family: tuple,
        names: list[str],
        state: list[Tensor],
        leaves: list,
        spec: Any,
        tensors: list[Tensor],
        donated: list[int],
    ) -> Program:
        batch_names = [f"args{pytree.keystr(p)}" for p, x in _paths(leaves, spec) if _is_t(x)]
        described = _describe(leaves)
        reason = self.cache.reason(key, family, batch_names, tensors)
        dynamic = self.cache.plan(family, tensors)
        n_state = len(state)
        is_tensor = [isinstance(x, Tensor) for x in leaves]
        constants = [x for x in leaves if not isinstance(x, Tensor)]
        meta: dict[str, Any] = {}
        grad_mode = torch.is_grad_enabled()

        def body(*flat: Tensor) -> tuple[Tensor, ...]:
            batch_in, consts = iter(flat[n_state:]), iter(constants)
            call = [next(batch_in) if t else next(consts) for t in is_tensor]
            call_args, call_kwargs = pytree.tree_unflatten(call, spec)
            with (
                self.capture.installed(names, flat[:n_state]) as exit_,
                torch.set_grad_enabled(grad_mode),
            ):
                result = self.fn(*call_args, **call_kwargs)
            out, out_spec = pytree.tree_flatten(result)
            kinds: list[Any] = []
            produced: list[Tensor] = []
            free = {i: flat[n_state + i] for i in donated}
            for value in out:
                if not isinstance(value, Tensor):
                    kinds.append(("constant", value))
                    continue
                target = donation_target(value, free)
                if target is None:
                    kinds.append("tensor")
                    produced.append(value.detach())
                    continue
                placeholder = free.pop(target)
                if value is not placeholder:
                    with torch.no_grad():
                        placeholder.copy_(value)  # functionalized: a write at the very end
                kinds.append(("donated", target))
            meta.update(exit=exit_, out_spec=out_spec, kinds=kinds, n_out=len(produced))
            new_grads = [g.detach() for g in exit_.traced_grads]
            exit_.traced_grads = []
            return (*produced, *new_grads)

        example = [*state, *tensors]
        started = time.perf_counter()
        gm, fakes, size_guard = self._trace(body, example, n_state, dynamic, described)
        used = drop_unused_inputs(gm)
        traced_at = time.perf_counter()
        exit_ = meta["exit"]
        fingerprint = graph_fingerprint(
            gm,
            [(names[i] if i < n_state else f"batch {i - n_state}") for i in used],
            [TensorSpec.of(example[i]) for i in used],
            (exit_.signature(), meta["out_spec"], _kinds_key(meta["kinds"])),
        )
        symbolic = fakes is not None
        reuse = None if symbolic else self._by_fingerprint.get(fingerprint)
        if reuse is not None:
            run = reuse.run
            self.reused += 1
        else:
            check_generators(gm, self.backend, self._holder)
            run = compile_graph(
                gm,
                [example[i] for i in used],
                self.backend,
                fakes=[fakes[i] for i in used] if symbolic else None,
                options=self.inductor_options,
            )
        guard = None
        dims: dict[str, list[int]] = {}
        if symbolic:
            guard = SizeGuard(fakes[n_state:], dynamic, size_guard)
            fixed = {(i, d) for i, d, _ in guard.static}
            for i, ds in enumerate(dynamic):
                kept = sorted(d for d in ds if (i, d) not in fixed)
                if kept:
                    dims[batch_names[i]] = kept
        program = Program(
            run=run,
            graph=gm,
            used=used,
            exit=exit_,
            out_spec=meta["out_spec"],
            out_kinds=meta["kinds"],
            n_out=meta["n_out"],
            fingerprint=fingerprint,
            guard=guard,
            random=draws_random(gm),
            donated=donated_targets(meta["kinds"]),
        )
        if reuse is not None:
            # Not a new trace in the account (nothing was compiled): the exact key maps to
            # the graph compiled before.
            self.cache._exact[key] = program
            return program
        if not symbolic:
            self._by_fingerprint[fingerprint] = program
        self.cache.check_budget(reason, described)
        record = TraceRecord(
            number=self.cache.num_traces + 1,
            reason=reason,
            signature=described,
            dynamic=dims,
            trace_s=traced_at - started,
            compile_s=time.perf_counter() - traced_at,
        )
        self.cache.add(key, family, program, names=batch_names, tensors=tensors, record=record)
        return program

    def _trace(
        self,
        body: Callable[..., Any],
        example: list[Tensor],
        n_state: int,
        dynamic: list[frozenset[int]],
        described: str,
    ) -> tuple[GraphModule, list[Tensor] | None, str | None]:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        detached = [t.detach() for t in example]
        symbolic = any(dynamic)
        devices = sorted({t.device.index or 0 for t in example if t.is_cuda})
        holder = self._holder
        try:
            with (
                OuterStateWatch(self.fn),
                _AttributeWatch(holder),
                _HostRandomWatch(),
                _HeldRandomWatch(holder),
                _quiet_fake_tensor_log(),
                torch.random.fork_rng(devices=devices),
            ):
                if symbolic:
                    fakes = _symbolic_fakes(detached, [frozenset()] * n_state + list(dynamic))
                    mode = "symbolic"
                else:
                    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
                    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in detached]
                    mode = "fake"
                dropout = _eager_dropout() if symbolic else contextlib.nullcontext()
                with dropout:
                    # Fresh handles per pass: the body marks its parameters as requiring
                    # grad and sets their .grad, which the second pass must not see.
                    first = make_fx(body, tracing_mode=mode)(*[f.detach() for f in fakes])
                    functional = torch.func.functionalize(first, remove="mutations")
                    gm = make_fx(functional, tracing_mode=mode)(*[f.detach() for f in fakes])
        except Exception as exc:
            raise self._trace_error(exc, described) from exc
        bernoulli_in_place(gm)
        direct_writes(gm)
        if not symbolic:
            return gm, None, None
        shape_env = fakes[0].fake_mode.shape_env
        batch = [f for f, dims in zip(fakes[n_state:], dynamic, strict=True) if dims]
        return gm, fakes, shape_env.produce_guards_expression(batch)

    def _trace_error(self, exc: Exception, described: str) -> Exception:
        if getattr(exc, "_functacc_user_error", False) or isinstance(exc, TraceError):
            return exc
        if "convert all Tensors to FakeTensors" in str(exc):
            return TraceError(
                "the step read a tensor that is none of its inputs: not an argument of the "
                f"call, not a parameter, buffer or tensor attribute of the modules "
                f"({', '.join(self.capture.labels) or 'none given'}), not optimizer state. "
                "functacc.jit would have to bake it into the graph as a constant, where eager "
                "reads it afresh on every call.\n"
                f"  the op: {str(exc).split('Found in', 1)[-1].strip()[:300]}\n"
                "Fix: pass the tensor as an argument of the call, or give the module that "
                "holds it in modules=(...) (a teacher model, an EMA copy), or give its "
                "optimizer in optimizers=(...). A parameter list taken before the call "
                "(params = list(model.parameters())) holds the real tensors: read them "
                "through the module inside the step instead."
            )
        return _translate(exc, self._holder, described)


def _kinds_key(kinds: list[Any]) -> tuple:
    return tuple(
        k if isinstance(k, str) or k[0] == "donated" else ("constant", hashable_constant(k[1]))
        for k in kinds
    )


def _holder(capture: Capture) -> nn.Module:
    """The modules under one root, for error messages that name a module by its label."""
    holder = nn.Module()
    for label, module in zip(capture.labels, capture.modules, strict=True):
        holder.add_module(label, module)
    return holder


def _is_t(x: Any) -> bool:
    return isinstance(x, Tensor)


def _paths(leaves: list, spec: Any) -> list[tuple[Any, Any]]:
    tree = pytree.tree_unflatten(leaves, spec)
    return pytree.tree_flatten_with_path(tree)[0]


def _describe(leaves: list) -> str:
    parts = [describe_tensor(x) if isinstance(x, Tensor) else repr(x) for x in leaves]
    return "; ".join(parts) or "no inputs"
