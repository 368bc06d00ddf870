"""One trace of a jitted step body: the flat function of tensors the tracer runs.

:class:`TracedBody` is what :class:`~.body.StepBody` hands the engine to trace. It puts the
traced inputs where the body reads them (the modules' tables, ``.grad``, the optimizers, the
Python locations fed to the graph), calls the body, and turns what the body leaves behind
into the graph's outputs, in this order:

1. the tensors the body returns (those written into a donated argument's memory are not
   outputs: their copy is one of the graph's final writes);
2. the new ``.grad`` tensors (:class:`Exit`);
3. the Python values the body returns or writes that the graph computes: ``loss.item()``,
   a counter's new value, a tensor stored on an object (:mod:`.python_trace`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .averaged_model import averages_in_graph
from .body_errors import counting_backwards
from .c10d_in_trace import collectives_in_graph
from .constant_values import batch_values, known_value
from .data_assign import data_assignments_written
from .donation import donation_target
from .grad_clears import FirstGradAccess
from .grad_scaler import scalers_step_in_graph
from .lookup_tables import as_lookup
from .python_code import code_scopes, function_attributes_kept
from .python_iterators import no_batches_drawn, outside_iterators
from .python_location import Location, Root
from .python_memo import memo_owners, memoized_uncached
from .python_numbers import symbolic_builtins
from .python_reach import entries, is_user_code, plain_objects
from .python_state import generator_key
from .python_trace import Recorder
from .tensor_equal import EqualAtTrace
from .torch_checkpoint import no_checkpoint_draws
from .value_checks import value_checks_in_graph

__all__ = [
    "Exit",
    "GradExit",
    "TracedBody",
    "ValueGuard",
    "known_generators",
    "mask_checks_on_values",
]


GradExit = Literal["kept", "new", "none", "dropped"]
"""What a parameter's ``.grad`` is after the body: the tensor it came in as (perhaps
written in place), a new tensor (an output of the graph), ``None``, or a new tensor that
ZeRO-2 does not keep past the call (``None`` after it)."""


@dataclass
class Exit:
    """What the traced body left behind, beyond its return value and in-place writes."""

    grads: dict[str, GradExit] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    stepped: list[frozenset[str]] = field(default_factory=list)  # per optimizer
    traced_grads: list[Tensor] = field(default_factory=list)  # while tracing: the new ones

    def signature(self) -> tuple:
        return (
            tuple(self.grads.items()),
            tuple(self.requires_grad.items()),
            tuple(tuple(sorted(s)) for s in self.stepped),
        )


_NUMBER_KINDS = {torch.SymFloat: (float, torch.float64), torch.SymInt: (int, torch.int64)}


class TracedBody:
    """``body(*state, *fed, *batch) -> (*returned, *new_grads, *python_values)``."""

    def __init__(
        self,
        step: Any,  # the StepBody
        names: list[str],
        n_state: int,
        fed: list[Location],
        leaves: list,
        spec: Any,
        donated: list[int],
    ):
        self.step = step
        self.names = names
        self.n_state = n_state
        self.fed = fed
        self.is_tensor = [isinstance(x, Tensor) for x in leaves]
        self.leaves = leaves  # its numbers are the fed symbols while the body is traced
        self.spec = spec
        self.donated = donated
        self.grad_mode = torch.is_grad_enabled()
        # Filled in by the trace:
        self.recorder: Recorder | None = None
        self.exit = Exit()
        self.out_spec: Any = None
        self.kinds: list[Any] = []
        self.n_out = 0
        self.n_grads = 0
        self.numbers: list[tuple[int, type]] = []  # Python outputs that are numbers, by kind
        self.real_batch = [x for x in leaves if isinstance(x, Tensor)]
        self.value_guarded: dict[int, str] = {}  # batch tensors whose values it read: where
        self.cleared: frozenset[str] = frozenset()  # absent .grad zero_grad() cleared first

    def __call__(self, *flat: Tensor) -> tuple[Any, ...]:
        n_fixed = self.n_state + len(self.fed)
        python, capture = self.step.python, self.step.capture
        # The batch's tensors as traced, in the order of the real ones (numbers are fed as
        # symbols among them).
        traced_batch = [t for t in flat[n_fixed:] if isinstance(t, Tensor)]
        # Before the recording starts (a torchmetrics Metric's hash, met by modules(), reads
        # its list states).
        scopes = module_scopes(self.step.fn, capture.modules)
        memo = memo_owners(scopes, capture.modules)
        with (
            python.scope(self.fed, flat[self.n_state : n_fixed]) as recorder,
            batch_values(traced_batch, self.real_batch, self.value_guarded),
            mask_checks_on_values(),
        ):
            batch_in = iter(flat[n_fixed:])  # the numbers: fed symbols by now (python_args)
            call = [
                next(batch_in) if t else as_lookup(x)
                for t, x in zip(self.is_tensor, self.leaves, strict=True)
            ]
            call_args, call_kwargs = pytree.tree_unflatten(call, self.spec)
            self.recorder = recorder
            remat = self.step.remat
            with (
                capture.installed(self.names, flat[: self.n_state], recorder) as exit_,
                torch.set_grad_enabled(self.grad_mode),
                remat.active() if remat is not None else contextlib.nullcontext(),
                scalers_step_in_graph() if self.step.scalers else contextlib.nullcontext(),
                no_checkpoint_draws(),
                # A torch.compile'd module or function in the body is traced through (the
                # whole step is compiled here); Dynamo refuses FX's trace by default.
                torch._dynamo.config.patch(error_on_nested_fx_trace=False),
                symbolic_builtins(scopes=scopes),
                no_batches_drawn(outside_iterators(python.roots, self.leaves, recorder.objects)),
                function_attributes_kept(self.step.fn, python.roots),
                memoized_uncached(memo),
                collectives_in_graph(),
                value_checks_in_graph(),
                EqualAtTrace(),
                averages_in_graph(),
                data_assignments_written(),
                counting_backwards(self.step.engine.cache.what, self.step.fn) as returned,
                FirstGradAccess(self._absent_grads(flat), _real(capture)) as first_access,
            ):
                result = self.step.fn(*call_args, **call_kwargs)
                out, self.out_spec = pytree.tree_flatten(result)
                returned.extend(out)
            self.cleared = frozenset(first_access.cleared)
            free = {i: flat[n_fixed + i] for i in self.donated}
            self._donated_inputs = list(free.values())
            produced = self._returned(out, free, flat[self.n_state : n_fixed])
            recorder.finish()  # the body's writes, as effects (may ask for another trace)
            self.exit = exit_
            new_grads = [g.detach() for g in exit_.traced_grads]
            exit_.traced_grads = []
            self.n_out, self.n_grads = len(produced), len(new_grads)
            # A Python number the graph computes (loss.item(), a counter) leaves it as a
            # 0-dim tensor (Inductor returns tensors) and is made a number after the run.
            python = []
            self.numbers = []
            for k, value in enumerate(recorder.outputs):
                if not isinstance(value, Tensor):
                    kind = _NUMBER_KINDS.get(type(value), (bool, torch.bool))
                    self.numbers.append((k, kind[0]))
                    value = torch.scalar_tensor(value, dtype=kind[1])
                python.append(value)
            return (*produced, *new_grads, *python)

    def _absent_grads(self, flat: Sequence[Any]) -> dict[int, str]:
        """The traced parameters that hold no ``.grad``: their ``id``, their gradient's name."""
        names = set(self.names)
        return {
            id(flat[i]): f"grad {name[6:]}"
            for i, name in enumerate(self.names)
            if name.startswith("param ") and f"grad {name[6:]}" not in names
        }

    def _returned(self, out: list, free: dict[int, Tensor], fed: Sequence[Any]) -> list[Tensor]:
        """The kinds of the returned leaves, and the tensors among them that are outputs.

        A returned tensor that *is* a donated input stays where it is; the others take the
        memory of a donated input of their shape. Every donated input is read before any is
        written: a value that shares memory with one (``{"a": s["b"] + 1, "b": s["a"]}``
        donated, or a view of one) is copied out first, as eager's values are separate."""
        assert self.recorder is not None
        kept = {id(v) for v in out if isinstance(v, Tensor) and any(v is p for p in free.values())}
        targets: dict[int, int] = {}
        for i, p in list(free.items()):
            if id(p) in kept:
                targets[id(p)] = i
                del free[i]
        values = []
        for value in out:
            shared = isinstance(value, Tensor) and id(value) not in targets
            if shared and any(_shares_memory(value, p) for p in self._donated_inputs):
                value = value.clone()
            values.append(value)
        produced: list[Tensor] = []
        self.kinds = []
        writes = []
        for value in values:
            if not isinstance(value, Tensor):
                template = self.recorder.template(value, "the step's return value")
                if template[0] == "const":
                    self.kinds.append(("constant", template[1]))
                else:
                    self.kinds.append(("python", template))
                continue
            if id(value) in targets:
                self.kinds.append(("donated", targets.pop(id(value))))
                continue
            j = next((j for j, f in enumerate(fed) if f is value), None)
            if j is not None:  # a tensor of the Python state: that object, as eager returns
                self.kinds.append(("fed", j))
                continue
            target = donation_target(value, free)
            if target is None:
                self.kinds.append("tensor")
                produced.append(value.detach())
                continue
            writes.append((free.pop(target), value))
            self.kinds.append(("donated", target))
        with torch.no_grad():
            for placeholder, value in writes:
                placeholder.copy_(value)  # functionalized: a write at the very end
        return produced


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a is b or torch._C._is_alias_of(a, b)


class ValueGuard:
    """The values of batch tensors that a trace branched on (an attention mask), as a
    signature part: the index of the distinct value each has (the same tensor, unchanged
    since the last check, costs no comparison)."""

    def __init__(self) -> None:
        self._seen: dict[int, list[tuple[Tensor, Tensor, int]]] = {}

    def key(self, positions: dict[int, str], tensors: list[Tensor]) -> tuple:
        return tuple(
            (f"batch tensor {i}'s values, read at {site} (which so far)", self._token(i, t))
            for i, site in sorted(positions.items())
            if i < len(tensors) and (t := tensors[i]) is not None
        )

    def _token(self, i: int, t: Tensor) -> int:
        seen = self._seen.setdefault(i, [])
        for k, (ref, last, version) in enumerate(seen):
            if last is t and t._version == version:
                return k
            if ref.shape == t.shape and ref.dtype == t.dtype and torch.equal(ref, t):
                seen[k] = (ref, t, t._version)
                return k
        seen.append((t.detach().clone(), t, t._version))
        return len(seen) - 1


@contextlib.contextmanager
def mask_checks_on_values() -> Iterator[None]:
    """While tracing: torch's check whether an attention mask is causal
    (``nn.TransformerEncoder(src, mask=...)`` compares the mask's values with a causal one)
    runs on the real mask where the mask is an argument of the call (its values then part
    of the step's signature: a mask with other values traces again, as eager would take the
    other branch), or one the step makes from its sizes alone (torch's seq2seq tutorial's
    ``create_mask``): :func:`~.constant_values.known_value`."""
    from torch.nn.modules import transformer

    original = transformer._detect_is_causal_mask

    def detect(mask: Any, is_causal: Any = None, size: Any = None) -> bool:
        value = None if mask is None or is_causal is not None else known_value(mask)
        if value is None:
            return original(mask, is_causal, size)
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        with disable_proxy_modes_tracing(), unset_fake_temporarily():  # real values, eagerly
            return bool(original(value, is_causal, size))

    transformer._detect_is_causal_mask = detect
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original


def known_generators(
    modules: Sequence[nn.Module], roots: Sequence[Root]
) -> dict[int, tuple[torch.Generator, Tensor]]:
    """The ``torch.Generator`` objects the modules and the body's Python state hold now,
    with their states: a generator a trace finds in the graph that is not among them was
    made by the body. Keyed by :func:`generator_key`."""
    found: dict[int, tuple[torch.Generator, Tensor]] = {}

    def note(value: Any) -> None:
        if isinstance(value, torch.Generator) and generator_key(value) not in found:
            found[generator_key(value)] = (value, value.get_state())

    for module in modules:
        for m in module.modules():
            for value in vars(m).values():
                note(value)
                if isinstance(value, (list, tuple, dict)):
                    for v in value.values() if isinstance(value, dict) else value:
                        note(v)
    for root in roots:
        note(root.get())
    for _, obj in plain_objects(list(roots)).values():
        for _, _, v in entries(obj):
            note(v)
    return found


def module_scopes(fn: Any, modules: Sequence[nn.Module] = ()) -> list[dict]:
    """The globals of the user's modules whose code the step runs: the body's and those of
    the functions it calls (python_code.code_scopes; compile_step's ``loss_fn``), and of
    the classes of ``modules`` (MoCo's ``int(self.queue_ptr)`` in its builder.py), for
    :func:`symbolic_builtins`."""
    scopes = code_scopes(fn)
    classes = {type(sub) for m in modules for sub in m.modules()}
    scopes += [vars(sys.modules[c.__module__]) for c in classes if c.__module__ in sys.modules]
    user = [s for s in scopes if isinstance(s, dict) and is_user_code(s.get("__name__", ""))]
    return list({id(s): s for s in user}.values())


def _real(capture: Any) -> dict[int, str]:
    """The step's parameters themselves, by ``id``, to their names: their ``.grad`` read or
    set while traced is none of the trace's (grad_clears.FirstGradAccess)."""
    return {id(p): n for n, p in capture.params.items()}
