"""What a jitted step does in Python besides its graph, replayed on every call as eager would.

A trace (:mod:`.python_trace`) turns the body's Python writes into *effects*:

- ``("assign", location, template)`` / ``("delete", location)``: ``self.step = ...``, a
  closure or global variable, a dict entry, an optimizer's ``param_groups`` entry;
- ``("append", location, [template, ...])``: ``history.append(loss.item())``;
- :class:`SchedulerEvent`: ``lr_scheduler.step()``, run for real before the graph (where the
  body steps it before the optimizer) or after it;
- :class:`Seed`: ``torch.manual_seed(...)`` before any draw, run before the graph;
- ``("call", function, [template, ...], {name: template})``: ``print``, logging, ``tqdm``
  (:mod:`.python_output`), run after the graph.

A *template* says how a written value is made after each call: ``("const", value)``, ``("out",
k)`` (the graph's ``k``-th Python output: a tensor, or a number such as ``loss.item()`` or a
counter's ``u0 + 1``), a container or an object the step made (:mod:`.python_made`:
``(kind, item templates, extra)``), ``("lr", marker)`` (a
scheduler's learning rate after its replayed steps), or ``("fmt", text)`` (a string the
body formatted traced numbers into; ``("path", cls, text)`` for a path made of one).

Example:
    >>> build(("tuple", [("const", 1), ("out", 0)], None), [2.5], {})
    (1, 2.5)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TraceError
from .python_location import MISSING, Location
from .python_made import MADE, build_made
from .python_schedulers import LastLR, SchedulerEvent, patch_schedulers
from .torch_checkpoint import in_torch_checkpoint

__all__ = [
    "Effect",
    "LastLR",
    "SchedulerEvent",
    "Seed",
    "Template",
    "build",
    "patch_random_and_schedulers",
    "restorer",
]

Template = tuple


class Effect:
    """Constructors of effect tuples."""

    @staticmethod
    def assign(
        target: Location, value: Any, template: Callable[[Any, str], Template], *, where: str
    ) -> tuple:
        if value is MISSING:
            return ("delete", target)
        return ("assign", target, template(value, where))

    @staticmethod
    def call(
        function: Any, args: Sequence[Any], kwargs: dict, template: Callable, *, where: str
    ) -> tuple:
        """``function(*args, **kwargs)`` made after each call with its values (``print``, a
        file's write, a ``functacc.host`` function)."""
        made = [template(a, where) for a in args]
        return ("call", function, made, {k: template(v, where) for k, v in kwargs.items()})


def build(template: Template, outputs: Any, lrs: dict) -> Any:
    """The value a template stands for after a call (``outputs``: the graph's Python
    outputs; ``lrs``: the replayed schedulers' learning rates)."""
    kind = template[0]
    if kind == "const":
        return template[1]
    if kind == "out":
        return outputs[template[1]]
    if kind == "lr":
        marker = template[1]
        return lrs[id(marker.scheduler)][marker.count][marker.index]
    if kind in MADE:  # containers, objects made in the step
        memo = lrs.setdefault("made", {})  # type: ignore[call-overload]  # one per call
        return build_made(template, lambda t: build(t, outputs, lrs), memo)
    if kind == "odict":
        made = OrderedDict((k, build(t, outputs, lrs)) for k, t in template[1].items())
        if template[2] is not None:
            made._metadata = template[2]  # type: ignore[attr-defined]
        return made
    if kind == "numpy":  # tensor.numpy() in the step (python_numpy)
        array = build(template[1], outputs, lrs).numpy()
        scalar = len(template) > 3 and template[3]  # a NumPy scalar: array[()] of a 0-d one
        return array[template[2]] if template[2] or scalar else array
    if kind in ("fmt", "path"):
        from .python_output import fill

        if kind == "fmt":
            return fill(template[1], outputs, lrs)
        return template[1](fill(template[2], outputs, lrs))
    raise ValueError(f"not a template: {template!r}")


# -- seeds ---------------------------------------------------------------------------------
@dataclass
class Seed:
    """``torch.manual_seed(value)`` (or a CUDA seed) before any draw of the step."""

    function: Callable[[int], Any]
    value: Any  # an int, or a sympy expression over fed locations' symbols
    symbols: dict = field(default_factory=dict)  # sympy symbol -> Location

    def evaluate(self, values: dict[Location, Any]) -> int:
        if not self.symbols:
            return int(self.value)
        import sympy

        result = self.value.xreplace(
            {s: sympy.Integer(values[loc]) for s, loc in self.symbols.items()}
        )
        return int(result)


def _draws_so_far() -> int:
    """Random draws traced so far in the body (dropout, ``torch.rand``)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return 0
    seeded = torch.Tag.nondeterministic_seeded
    return sum(seeded in getattr(n.target, "tags", ()) for n in mode.tracer.graph.nodes)


def _seeding(recorder: Any, function: Callable[[int], Any], name: str) -> Callable:
    def seed(value: Any) -> Any:
        if _draws_so_far():
            raise TraceError(
                f"the step calls {name}() after it has drawn random numbers (dropout, "
                "torch.rand, ...). functacc.jit replays a seed the step sets before the graph "
                "runs, which matches eager only where the seed comes before every draw. Fix: "
                f"call {name}() at the start of the step, or before calling it."
            )
        if isinstance(value, torch.SymInt):
            expr = value.node.expr
            symbols = {s: recorder.symbols[s] for s in expr.free_symbols if s in recorder.symbols}
            if len(symbols) != len(expr.free_symbols):
                raise TraceError(
                    f"the step seeds {name}() with a value computed from tensor values "
                    "(.item()), which is known only once the graph has run, after its draws. "
                    "Fix: seed from Python numbers (a step counter), or outside the step."
                )
            recorder.seeds.append(Seed(function, expr, symbols))
        else:
            recorder.seeds.append(Seed(function, int(value)))
        return torch.default_generator

    return seed


def _refused(name: str, advice: str, original: Callable) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if in_torch_checkpoint():  # puts back the forward's state: see torch_checkpoint.py
            return original(*args, **kwargs)
        raise TraceError(
            f"the step calls {name}() while functacc.jit traces it. The step's random draws "
            f"are ops of its graph, drawn on every call; {advice}"
        )

    return refuse


def checkpoint_refused(owner: str) -> Callable[..., Any]:
    """``owner.state_dict()`` / ``load_state_dict`` in a traced step, refused: an optimizer's
    or a scheduler's state is the graph's then, or changes only after the call (a scheduler
    stepped in the step is replayed after it), so a checkpoint made there would not hold the
    call's values (a scheduler's was one step behind, silently, before 2026-11-28)."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        who = type(args[0]).__name__ if args and hasattr(args[0], "state_dict") else owner
        raise TraceError(
            f"the step calls {who}.state_dict() (or load_state_dict): while functacc.jit "
            "traces it, that state is the graph's or changes after the call, so a checkpoint "
            "made there would not hold the call's values. Fix: save or load it after the call "
            "(if it % every == 0: torch.save(opt.state_dict(), path) after step(...)); a "
            "model's state_dict() may be saved in the step."
        )

    return refused


def patch_random_and_schedulers(recorder: Any) -> Callable[[], None]:
    """While the body is traced: seeding functions and ``lr_scheduler`` steps are noted by
    ``recorder`` instead of run. Returns the function that puts them back."""
    import torch.cuda
    import torch.cuda.random
    import torch.random

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        if name in vars(owner):
            patches.append((owner, name, vars(owner)[name]))
            setattr(owner, name, value)

    seed_functions = {
        "torch.manual_seed": torch.random.manual_seed,
        "torch.cuda.manual_seed": torch.cuda.random.manual_seed,
        "torch.cuda.manual_seed_all": torch.cuda.random.manual_seed_all,
    }
    for label, function in seed_functions.items():
        stand_in = _seeding(recorder, function, label)
        short = label.rsplit(".", 1)[1]
        for owner in (
            (torch, torch.random)
            if label == "torch.manual_seed"
            else (
                torch.cuda,
                torch.cuda.random,
            )
        ):
            patch(owner, short, stand_in)
    unseedable = (
        (torch, "seed"),
        (torch.random, "seed"),
        (torch, "set_rng_state"),
        (torch.random, "set_rng_state"),
        (torch.cuda, "set_rng_state"),
        (torch.cuda, "set_rng_state_all"),
        (torch.cuda, "seed"),
        (torch.cuda, "seed_all"),
    )
    for owner, name in unseedable:
        patch(
            owner,
            name,
            _refused(
                f"{owner.__name__}.{name}",
                "a generator state set inside the step cannot be replayed before them. Fix: "
                "seed with torch.manual_seed(int) at the start of the step (replayed on every "
                "call), or set the state before calling the step.",
                getattr(owner, name, None),
            ),
        )

    patch_schedulers(recorder, patch, patches)
    return restorer(patches)


ABSENT = object()  # a patched attribute the owner did not have before


def restorer(patches: list[tuple[Any, str, Any]]) -> Callable[[], None]:
    """The function that puts back ``patches`` (owner, name, the value before; ``ABSENT``:
    none), the last first."""

    def undo() -> None:
        for owner, name, value in reversed(patches):
            if value is ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    return undo
