"""An eager step body (``jit``'s imperative and pure forms) over the shared engine.

The body (forward passes, ``backward()``, ``torch.autograd.grad``, ``opt.step()``, in-place
updates under ``torch.no_grad()``) runs over the state a :class:`~.capture.Capture` lifts
into named inputs. The engine (:mod:`.engine`) traces it with ``functional=True``: first
with autograd running, so the graph holds forward, backward and update as ATen ops with
eager's kernels (dropout draws eager's masks) and the body's in-place writes; then
functionalized, so every write into an input is a ``copy_`` at the very end, after all
computation that could fail: a call that fails changes nothing.

A new signature costs a trace (fake tensors, cheap) but not always a compile: a graph
identical to one compiled already (the same code over the same named inputs, the same
write-backs) reuses it. The usual step body starts with ``opt.zero_grad()``: its first
call comes with no ``.grad`` and its second with one, which the body discards; both
trace to the same graph, compiled once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..backends import Backend, CudaGraphRunner, check_cuda_graphs
from ..errors import TraceError
from .capture import Capture, Exit
from .diagnostics import describe_tensor, translate
from .donation import donated_positions, donated_targets, donation_target, poison
from .engine import Engine, Program
from .graph_passes import drop_unread_ops, drop_unused_inputs, written_inputs
from .graph_passes import fingerprint as graph_fingerprint
from .side_effects import OuterStateWatch
from .signature import AmbientWatch, TensorSpec, family_key, hashable_constant

__all__ = ["BodyProgram", "StepBody"]


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
    ):
        self.fn = fn
        self.capture = capture
        self.donate = donate
        self.cuda_graphs = cuda_graphs  # None: on where the step runs on CUDA (capturable)
        self.engine = Engine(
            what,
            backend=backend,
            holder=_holder(capture),
            inductor_options=inductor_options,
            dynamic=dynamic,
            max_traces=max_traces,
        )
        self.cache = self.engine.cache
        # Autocast on the CPU and, where there is one, the GPU: a body may run on either.
        self._ambient = AmbientWatch("cuda" if torch.cuda.is_available() else "cpu")
        self._last_state: list[Tensor | None] = []
        self._last_specs: list[TensorSpec | None] = []

    @property
    def reused(self) -> int:
        return self.engine.reused

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
        family = (family_key(tensors), context)
        program = self.engine.lookup(key, family, tensors)
        if program is None:
            program = self._build(key, family, names, state, leaves, spec, tensors, donated)
        flat = [*state, *tensors]
        outputs = self.engine.run(
            program, [flat[i] for i in program.used], lambda: _describe(leaves)
        )
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

    def _outputs(
        self, program: BodyProgram, outputs: Sequence[Tensor], tensors: list[Tensor]
    ) -> Any:
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
    ) -> BodyProgram:
        batch_names = [f"args{pytree.keystr(p)}" for p, x in _paths(leaves, spec) if _is_t(x)]
        plan = self.engine.plan(key, family, batch_names, tensors, _describe(leaves))
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
        stand_ins = self.capture.stand_ins(names, state)
        for i in stand_ins:  # ZeRO-2's missing gradients: a tensor of their own to trace
            example[i] = torch.empty_like(state[i])
        traced = self.engine.trace(
            body,
            example,
            plan,
            n_fixed=n_state,
            functional=True,
            strict=True,
            watches=[OuterStateWatch(self.fn)],
            on_error=lambda exc: self._trace_error(exc, plan.signature),
        )
        drop_unread_ops(traced.graph)
        used = drop_unused_inputs(traced.graph)
        read = [names[i].removeprefix("grad ") for i in stand_ins if i in used]
        if read:
            raise TraceError(
                f"{self.engine.cache.what} reads the gradient that its previous call left on "
                f"{', '.join(map(repr, read))}: it adds to it in backward() (accumulating over "
                "calls), reads it, or zeroes it in place (zero_grad(set_to_none=False)). Under "
                "ZeRO(2) a call's gradients do not outlive it (each rank keeps only its shard, "
                "inside the call), so .grad is None after the call where eager leaves them. "
                "Fix: clear them at the start of the step (opt.zero_grad()), accumulate "
                "micro-batches inside one call, or use parallel=functacc.parallel.ZeRO(1)."
            )
        exit_ = meta["exit"]
        fingerprint = graph_fingerprint(
            traced.graph,
            [(names[i] if i < n_state else f"batch {i - n_state}") for i in used],
            [TensorSpec.of(example[i]) for i in used],
            (exit_.signature(), meta["out_spec"], _kinds_key(meta["kinds"])),
        )
        program = BodyProgram(
            run=None,  # type: ignore[arg-type]  # set below
            graph=traced.graph,
            used=used,
            exit=exit_,
            out_spec=meta["out_spec"],
            out_kinds=meta["kinds"],
            n_out=meta["n_out"],
            fingerprint=fingerprint,
            donated=donated_targets(meta["kinds"]),
        )
        symbolic = traced.fakes is not None
        capture_graphs = self._captures(plan.devices)
        reuse = None if symbolic else self.engine.compiled(fingerprint)
        if reuse is not None:
            program.run = reuse
            self.engine.reused += 1
            self.engine.alias(plan, program)
        else:
            self.engine.check_budget(plan)
            program.run = self.engine.compile(traced, example, used=used, fingerprint=fingerprint)
            self.engine.keep(plan, program, traced, n_fixed=n_state)
        if capture_graphs:
            # The state's addresses are baked into a capture (a .grad the body replaces
            # every call is captured again); the batch is copied in, and a donated
            # argument's new value copied back out.
            program.run = CudaGraphRunner(
                program.run,
                sum(i < n_state for i in used),
                written=written_inputs(program.graph),
            )
        return program

    def _captures(self, devices: frozenset[torch.device]) -> bool:
        """Whether this program is captured as a CUDA graph (``cuda_graphs``, checked
        against the devices the step runs on and the ranks' collectives)."""
        if not devices and not self.cuda_graphs:
            return False
        device = min(devices, key=str) if devices else torch.device("cpu")
        ranks = dist.is_initialized() and dist.get_world_size() > 1
        collectives = dist.get_backend_config() if ranks else None
        return check_cuda_graphs(self.cuda_graphs, device, collectives)

    def _trace_error(self, exc: Exception, described: str) -> Exception:
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
        return translate(exc, self.engine.holder, described)


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
