"""The state a jitted step reads and writes, as one flat list of named tensors.

A step body uses modules and optimizers the way eager code does: ``model(x)``,
``loss.backward()``, ``p.grad``, ``opt.step()``, ``ema_p.mul_(0.99)``. To trace it as a pure
function, :class:`Capture` lifts their state into graph inputs: parameters, buffers and
plain tensor attributes of the given modules (each tensor once: tied weights and shared
submodules too), the ``.grad`` that exists, and each optimizer's state. While tracing,
the modules' tables, ``.grad`` and the optimizers' ``param_groups`` hold the traced
tensors (:meth:`Capture.installed`); what the body leaves behind is read off them
(:class:`Exit`) and, after each call, written back where eager would leave it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import argument_error, replaced_error
from .body_trace import Exit
from .diagnostics import describe_tensor
from .foreach_versions import ForeachVersions
from .functional import (
    check_dense_gradients,
    swap_attributes,
    unalias_reassigned,
    write_back_attributes,
)
from .model_watch import HookWatch, ModelWatch, StructureWatch
from .optimizers import TracedOptimizer, link_optimizer, trace_optimizer
from .python_tensors import optimizer_tensors
from .scalar_reads import buffer_reads

__all__ = ["Capture"]


class Capture:
    """The modules' and optimizers' state of one jitted step.

    ``labels`` name the modules in messages and state names (``generator.0.weight``);
    ``door`` is the call that builds the step (``functacc.jit``, ``compile_step``).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        labels: Sequence[str],
        optimizers: Sequence[torch.optim.Optimizer],
        optimizer_labels: Sequence[str],
        door: str = "functacc.jit",
    ):
        self.door = door
        self.modules = list(modules)
        self.labels = list(labels)
        self.params: dict[str, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}
        seen: dict[int, str] = {}
        for label, module in zip(self.labels, self.modules, strict=True):
            check_dense_gradients(module)
            for n, p in module.named_parameters():
                if id(p) not in seen:
                    seen[id(p)] = f"{label}.{n}"
                    self.params[f"{label}.{n}"] = p
            for n, b in module.named_buffers():
                if id(b) not in seen:
                    seen[id(b)] = f"{label}.{n}"
                    self.buffers[f"{label}.{n}"] = b
        # Tensors an optimizer updates that no module owns: parameters of the step too.
        self.loose = {id(p): p for p in optimizer_tensors(optimizers, optimizer_labels, seen)}
        self.params.update((seen[i], p) for i, p in self.loose.items())
        # Every submodule once, with its qualified name (for swapping table entries).
        self.submodules: dict[int, tuple[str, nn.Module]] = {}
        for label, module in zip(self.labels, self.modules, strict=True):
            for n, m in module.named_modules():
                self.submodules.setdefault(id(m), (f"{label}.{n}" if n else label, m))
        # Plain tensor attributes (not parameters or buffers): eager reads them afresh in
        # every forward, so they are inputs too, never constants of the graph.
        self.attributes = [
            (f"{qualified}.{attr}", m, attr)
            for qualified, m in self.submodules.values()
            for attr, value in vars(m).items()
            if isinstance(value, Tensor) and id(value) not in self.loose
        ]
        self.watch = ModelWatch(
            [m for _, m in self.submodules.values()],
            self.params,
            [*self.params.values(), *self.buffers.values()],
            names=[n for n, _ in self.submodules.values()],
        )
        names = {id(p): n for n, p in self.params.items()}
        self.optimizers = [
            link_optimizer(opt, names, label)
            for opt, label in zip(optimizers, optimizer_labels, strict=True)
        ]
        # Under torchrun: what backward() does with gradients over the ranks
        # (functacc.parallel.jit_grads: averaged whole, or reduce-scattered for ZeRO-2).
        self.strategy: Any = None
        # ZeRO-3: the optimizers' parameters kept as chunks between calls
        # (functacc.parallel.zero3_jit.ShardedParameters); the modules hold placeholders.
        self.rest: Any = None
        # ZeRO-2: parameters whose gradient the last call dropped where eager would have
        # left it in .grad; the next trace checks that the body does not read it.
        self.dropped: set[str] = set()
        # Tensor attributes the body assigns (written back into after each call).
        self.reassigned: set[int] = set()
        self._watched: tuple | None = None
        # The hot path of read(): names computed once, and the last results (returned as
        # the same objects while unchanged, so a call's signature compares by identity).
        self._fixed: tuple | None = None
        self._labelled: dict[int, tuple] = {}
        self._names: tuple[str, ...] = ()
        self._context: tuple = ()
        # Submodules or tensors replaced (registration hooks), hooks added or removed.
        self.structures = [StructureWatch(m) for m in self.modules]
        self.hooks = [
            HookWatch(m, {f"{label}.{n}": p for n, p in m.named_parameters()})
            for label, m in zip(self.labels, self.modules, strict=True)
        ]

    # -- per call ----------------------------------------------------------------------
    def read(self) -> tuple[tuple[str, ...], list[Tensor], tuple]:
        """The state's names and tensors now, and what else the graph depends on (train
        mode, trainable parameters, module attributes, optimizer structure). The names come
        back as the same tuple object while they are unchanged (the hot path of a call)."""
        rest = self.rest
        if rest is not None:
            rest.release()  # the first call after sync_modules(): shard the modules again
        if self._fixed is None:
            whole = {n: p for n, p in self.params.items() if rest is None or n not in rest.names}
            chunks = rest.chunks if rest is not None else {}
            carried = getattr(self.strategy, "carried", {})  # PowerSGD's factors and errors
            self._fixed = (
                [*(f"param {n}" for n in whole), *chunks, *(f"buffer {n}" for n in self.buffers)]
                + [f"comm {k}" for k in carried],
                [*whole.values(), *chunks.values(), *self.buffers.values(), *carried.values()],
                {n: f"grad {n}" for n in self.params},
            )
        fixed_names, fixed_tensors, grad_names = self._fixed
        names = list(fixed_names)
        tensors = list(fixed_tensors)
        for qualified, module, attr in self.attributes:
            value = vars(module).get(attr)
            if not isinstance(value, Tensor):
                raise argument_error(
                    f"the tensor attribute {qualified!r} is now {type(value).__name__}; the "
                    "step reads it as a tensor input on every call. Keep it a tensor (or "
                    f"register it as a buffer), or build the step again with {self.door}.",
                    TypeError,
                )
            names.append(f"attribute {qualified}")
            tensors.append(value)
        for n, p in self.params.items():
            grad = p.grad
            if grad is not None:
                names.append(grad_names[n])
                tensors.append(grad)
            elif n in self.dropped:
                # The gradient eager would hold here, which ZeRO-2 did not keep: the
                # parameter stands in for it (same shape and dtype; the trace replaces it
                # and makes sure the graph never reads it).
                names.append(grad_names[n])
                tensors.append(self._stand_in(n))
        watched = self.watch.key()
        if watched is not self._watched or any(w.replaced for w in self.structures):
            self._check_tables()
            self._watched = watched
        structure = []
        for opt in self.optimizers:
            structure.append((opt.label, opt.refresh()))
            paths, leaves = opt.leaves()
            labelled = self._labelled.get(id(paths))
            if labelled is None or labelled[0] is not paths:
                labelled = (paths, [f"{opt.label}{path}" for path in paths])
                self._labelled[id(paths)] = labelled
            names.extend(labelled[1])
            tensors.extend(leaves)
        hooks = tuple(h.key() for h in self.hooks)
        key = (
            watched,
            ("hooks", hooks),
            ("optimizer hyperparameters", tuple(structure)),
            ("parallel", getattr(self.strategy, "signature", tuple)()),
        )
        if key != self._context:
            self._context = key
        named = tuple(names)
        if named != self._names:
            self._names = named
        return self._names, tensors, self._context

    def settle(self) -> None:
        """After a call's Python writes: optimizers show state those writes created."""
        for opt in self.optimizers:
            settle = getattr(opt, "settle", None)
            if settle is not None:
                settle()

    def sync_hyperparameters(self) -> None:
        """The optimizers' hyperparameter inputs follow ``param_groups`` again (a scheduler
        stepped between :meth:`read` and the run)."""
        for opt in self.optimizers:
            opt.refresh()

    def stand_ins(self, names: Sequence[str], tensors: Sequence[Tensor]) -> list[int]:
        """The positions in :meth:`read`'s lists where a parameter stands for the gradient
        that ZeRO-2 dropped after the last call."""
        return [
            i
            for i, (n, t) in enumerate(zip(names, tensors, strict=True))
            if n.startswith("grad ") and t is self._stand_in(n.removeprefix("grad "))
        ]

    def _stand_in(self, name: str) -> Tensor | None:
        """What stands for ``name``'s dropped gradient: the parameter (its shape), or under
        ZeRO-3, where the module holds a placeholder, a tensor of the whole shape."""
        if self.rest is not None and name in self.rest.names:
            return self.rest.like(name)
        return self.params.get(name)

    def _check_tables(self) -> None:
        """A parameter, buffer or submodule replaced or added after the step was built
        (``model.fc = nn.Linear(...)``, ``model.double()``): the step would go on training
        the old tensors while the module uses the new ones. Eager would use the new."""
        for label, module, structure in zip(
            self.labels, self.modules, self.structures, strict=True
        ):
            check_dense_gradients(module)  # a sparse embedding unfrozen since
            structure.rescan()
            if structure.replaced is not None:
                raise replaced_error(f"{label}.{structure.replaced}", self.door)

    @contextlib.contextmanager
    def installed(
        self, names: Sequence[str], inputs: Sequence[Tensor], python: Any = None
    ) -> Iterator[Exit]:
        """While tracing: the modules, ``.grad`` and optimizers hold the traced ``inputs``
        (named as :meth:`read` names them). On leaving, the state the body left behind is
        written into the inputs (the graph's final writes) and described in the yielded
        :class:`Exit`. ``python``: the trace's :class:`~.python_trace.Recorder`, told of
        each ``opt.step()`` and given the optimizers' hyperparameter inputs."""
        by_name = dict(zip(names, inputs, strict=True))
        leaves: dict[str, Tensor] = {}
        gathered = self.rest.gather(by_name) if self.rest is not None else {}
        for n, p in self.params.items():
            leaf = gathered[n] if n in gathered else by_name[f"param {n}"]
            if p.requires_grad:
                leaf.requires_grad_(True)
                # The parameter's gradient hooks run on the traced tensor that stands for
                # it, as backward() runs them on the parameter: each contribution before it
                # is accumulated (register_hook), then after (post-accumulate hooks).
                for hook in (p._backward_hooks or {}).values():
                    leaf.register_hook(hook)
                for hook in (p._post_accumulate_grad_hooks or {}).values():
                    leaf.register_post_accumulate_grad_hook(hook)
            leaf._functacc_parameter = isinstance(p, nn.Parameter)  # print(model.bias)
            grad = by_name.get(f"grad {n}")
            if grad is not None:
                leaf.grad = grad
            leaves[n] = leaf
        # Buffers run on copies written back at the end: native_batch_norm updates its
        # running statistics without declaring the write in its schema, so a write into
        # the input itself would be invisible to functionalization (and lost).
        buffers = {n: by_name[f"buffer {n}"].clone() for n in self.buffers}
        swap = {id(p): leaves[n] for n, p in self.params.items()}
        swap.update({id(b): buffers[n] for n, b in self.buffers.items()})
        tables = [
            (table, key, value)
            for _, m in self.submodules.values()
            for table in (m._parameters, m._buffers, vars(m))
            for key, value in table.items()
            if isinstance(value, Tensor)
            and id(value) in swap
            and (table is not vars(m) or id(value) in self.loose)
        ]
        if python is not None:  # where the body's variables and objects hold them too
            python.install_held(swap)
        attribute_inputs = [by_name[f"attribute {q}"] for q, _, _ in self.attributes]
        traced_opts = []
        for opt in self.optimizers:
            paths, _ = opt.leaves()
            placeholders = [by_name[f"{opt.label}{path}"] for path in paths]
            traced_opts.append(trace_optimizer(opt, placeholders, leaves.__getitem__, python))
        if python is not None:
            for i, traced in enumerate(traced_opts):
                for j, hyper in enumerate(traced.hyperparameters()):
                    python.hyper[(i, j)] = hyper
        exit_ = Exit()
        with contextlib.ExitStack() as stack:
            for table, key, value in tables:
                table[key] = swap[id(value)]
            stack.callback(_restore, tables)
            reassigned = stack.enter_context(swap_attributes(self.attributes, attribute_inputs))
            for traced in traced_opts:
                stack.enter_context(traced)
            if self.strategy is not None:
                carried = {k: by_name[f"comm {k}"] for k in getattr(self.strategy, "carried", {})}
                stack.enter_context(self.strategy.reducing_backward(leaves, carried))
            if self.rest is not None:  # ZeRO-3: backward gathers the parameters again
                stack.enter_context(self.rest.regathering())
            stack.enter_context(ForeachVersions())  # as eager counts foreach writes
            stack.enter_context(buffer_reads(self, self.buffers, buffers, python))
            yield exit_
            self._leave(by_name, leaves, buffers, tables, traced_opts, exit_)
        write_back_attributes(self.attributes, attribute_inputs, reassigned)
        self.reassigned.update(reassigned)

    def unalias(self) -> bool:
        """After a trace: the attributes it assigns get their own copies where they share
        memory with a parameter (functional.unalias_reassigned); whether any did."""
        model_tensors = [*self.params.values(), *self.buffers.values()]
        return unalias_reassigned(self.attributes, self.reassigned, model_tensors)

    def _leave(
        self,
        by_name: dict[str, Tensor],
        leaves: dict[str, Tensor],
        buffers: dict[str, Tensor],
        tables: list,
        traced_opts: list[TracedOptimizer],
        exit_: Exit,
    ) -> None:
        name_of = {id(t): n for n, t in [*self.params.items(), *self.buffers.items()]}
        current = dict(buffers)
        for table, key, value in tables:
            n, now = name_of[id(value)], table[key]
            if n in self.params and now is not leaves[n]:
                raise argument_error(
                    f"the step replaced the parameter {n!r}; a jitted step updates parameters "
                    "in place (p.copy_(...), p.add_(...) under torch.no_grad()). Assigning a "
                    "new Parameter inside the step is not supported."
                )
            if n in self.buffers and now is not buffers[n]:
                # module.running_mean = ...: eager leaves the new tensor there; the step
                # writes its value into the buffer.
                current[n] = now
        if self.strategy is not None and current:
            # Every rank ends the step with the same statistics (their mean), as
            # compile_step's data parallel does.
            current = self.strategy.sync_buffers(current)
        with torch.no_grad():
            for n in self.buffers:
                value, placeholder = current[n], by_name[f"buffer {n}"]
                kept = (placeholder.shape, placeholder.dtype)
                if not isinstance(value, Tensor) or (value.shape, value.dtype) != kept:
                    got = describe_tensor(value) if isinstance(value, Tensor) else repr(value)
                    raise argument_error(
                        f"the step assigned {got} to the buffer {n!r}, which holds "
                        f"{describe_tensor(placeholder)}; keep its shape and dtype."
                    )
                placeholder.copy_(value)
        for traced in traced_opts:
            traced.write_back()
            exit_.stepped.append(frozenset(traced.stepped))
        if self.rest is not None:
            self.rest.leave(leaves)
        with torch.no_grad():  # the communication's state for the next call
            for k, value in getattr(self.strategy, "carried_out", dict)().items():
                by_name[f"comm {k}"].copy_(value)
        for n, leaf in leaves.items():
            grad = leaf.grad
            given = by_name.get(f"grad {n}")
            if grad is None:
                exit_.grads[n] = "none"
            elif grad is given:
                exit_.grads[n] = "kept"
            elif self.strategy is not None and n in self.strategy.transient:
                exit_.grads[n] = "dropped"  # ZeRO-2: not kept whole past the call
            else:
                exit_.grads[n] = "new"
                exit_.traced_grads.append(grad)
            exit_.requires_grad[n] = leaf.requires_grad

    def apply_exit(self, exit_: Exit, new_grads: Sequence[Tensor]) -> None:
        """After a successful call: ``.grad``, ``requires_grad`` and the optimizers' state
        as eager leaves them."""
        fresh = iter(new_grads)
        getattr(self.strategy, "called", lambda: None)()  # PowerSGD counts warm-up calls
        for n, p in self.params.items():
            status = exit_.grads[n]
            if status == "new":
                p.grad = next(fresh)
            elif status in ("none", "dropped") and p.grad is not None:
                p.grad = None
            if status == "dropped":
                self.dropped.add(n)
            elif status != "kept":
                self.dropped.discard(n)
            if p.requires_grad != exit_.requires_grad[n]:
                p.requires_grad_(exit_.requires_grad[n])
        for opt, stepped in zip(self.optimizers, exit_.stepped, strict=True):
            opt.install(stepped)


def _restore(tables: list) -> None:
    for table, key, value in tables:
        table[key] = value
