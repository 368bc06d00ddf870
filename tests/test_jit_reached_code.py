"""The user's code a jitted step runs beyond its body: its Python state is followed too.

functacc.jit follows what the body's code names (its closure cells, the globals it and the
functions it calls by name read). Before 2026-11-28 the code it ran beyond that was not
followed: a model's ``forward`` that counted its calls in a global dict, a callback the body
took from a dict (``hooks["on_step"]()``) that bumped a counter. Their writes were made only
when the step was traced, silently (2 after 4 calls, eager 4), and a global constant they
read was baked into the graph. Now their globals and cells are the step's state
(core/python_code.py): written after every call, and guarded or fed where read.

Reference: the same loop run eagerly; counters and parameters compared exactly (the same
float32 ops in the same order on the eager backend).
"""

from __future__ import annotations

import functools
import itertools
import types

import pytest
import step_settings
import torch
from helpers import minimize, seeded_linear
from torch import nn

import functacc

CALLS = {"forward": 0, "callback": 0}
SETTINGS = types.SimpleNamespace(scale=1.0, seen=0)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["forward"] += 1  # a global the body never names
        return self.linear(x) * SETTINGS.scale


def on_step(loss: torch.Tensor) -> None:
    CALLS["callback"] += 1
    SETTINGS.seen += 1


HOOKS = {"on_step": on_step}


def run(jit: bool, calls: int = 4, backend: str = "eager") -> tuple[dict, int, list[torch.Tensor]]:
    CALLS.update(forward=0, callback=0)
    SETTINGS.scale, SETTINGS.seen = 1.0, 0
    torch.manual_seed(0)
    model = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = minimize(opt, model(x).pow(2).mean())
        HOOKS["on_step"](loss)
        return loss

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend=backend)
    g = torch.Generator().manual_seed(1)
    for i in range(calls):
        SETTINGS.scale = 1.0 if i < 2 else 0.5  # read by forward: changed between calls
        step(torch.randn(4, 3, generator=g))
    return dict(CALLS), SETTINGS.seen, [p.detach().clone() for p in model.parameters()]


def test_a_forward_and_a_callback_writing_globals_match_eager() -> None:
    calls, seen, params = run(jit=False)
    jit_calls, jit_seen, jit_params = run(jit=True)
    assert calls == {"forward": 4, "callback": 4} and seen == 4
    assert jit_calls == calls and jit_seen == seen  # before: {2, 2} and 2
    # The global scale forward reads: eager's at every call (before: the trace's 1.0).
    assert all(torch.equal(a, b) for a, b in zip(jit_params, params, strict=True))


@pytest.mark.inductor
def test_a_forward_and_a_callback_writing_globals_under_inductor() -> None:
    # The same Python state under Inductor: counts exact, weights within Inductor's rounding.
    calls, seen, params = run(jit=False)
    jit_calls, jit_seen, jit_params = run(jit=True, backend="inductor")
    assert jit_calls == calls == {"forward": 4, "callback": 4} and jit_seen == seen == 4
    for a, b in zip(jit_params, params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["forward", "callback"])
def test_code_beyond_the_body_is_followed_only_where_it_is_the_users(where: str) -> None:
    from functacc.core.python_code import reached_code
    from functacc.core.python_reach import find_roots

    if where == "callback":  # held in a dict the body reads
        found = reached_code([], find_roots(lambda: HOOKS))
    else:
        found = reached_code([("model", Counting())], [])
    names = {f.__name__ for f in found}
    assert names == ({"on_step"} if where == "callback" else {"__init__", "forward"})
    # torch's own modules' code is not the user's: nothing of nn.Linear's.
    assert reached_code([("linear", nn.Linear(2, 2))], []) == []


class Hinge(nn.Module):
    """A criterion of the user's with Python state, not in modules= (it holds no tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.margin, self.calls = 1.0, 0

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.margin - out).mean()


def test_a_criterion_not_in_modules_keeps_its_python_state_as_in_eager() -> None:
    # Before 2026-11-28: its margin was baked into the trace (losses from the third call
    # on computed with the second call's margin) and `calls` was 2 after 5 calls.
    runs = []
    for jit in (False, True):
        torch.manual_seed(0)
        model, crit = nn.Linear(3, 1), Hinge()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, model=model, crit=crit, opt=opt):
            loss = minimize(opt, crit(model(x)))
            return loss

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        losses = []
        for i in range(5):
            crit.margin = 1.0 + i  # changed between calls, as a schedule would
            losses.append(step(torch.randn(4, 3, generator=g)))
        runs.append((torch.stack(losses), crit.calls, getattr(step, "num_traces", 0)))
    (losses, calls, _), (jit_losses, jit_calls, traces) = runs
    assert torch.equal(jit_losses, losses) and jit_calls == calls == 5
    assert traces == 2  # the margin fed from the second call on: no trace per value


def test_a_config_modules_attributes_are_read_and_written_as_in_eager() -> None:
    # `import step_settings; step_settings.steps += 1`, and a scale read from it that the
    # loop changes: before 2026-11-28 the count was written at the traces only (2 after 4
    # calls) and the scale baked into the trace.
    runs = []
    for jit in (False, True):
        step_settings.steps, step_settings.scale = 0, 1.0
        model, opt = seeded_linear()

        def step(x, model=model, opt=opt):
            loss = minimize(opt, model(x).pow(2).mean() * step_settings.scale)
            step_settings.steps += 1
            return loss

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        g = torch.Generator().manual_seed(1)
        losses = []
        for i in range(5):
            step_settings.scale = 1.0 + i
            losses.append(step(torch.randn(4, 3, generator=g)))
        runs.append((torch.stack(losses), step_settings.steps, getattr(step, "num_traces", 0)))
    (losses, steps, _), (jit_losses, jit_steps, traces) = runs
    assert torch.equal(jit_losses, losses) and jit_steps == steps == 5 and traces <= 2


def test_next_of_an_iterator_held_in_a_dict_is_a_clear_error() -> None:
    # state["counter"] = itertools.count(): next() of it was made once, at the trace
    # (0, 1, 1, 1 where eager counts 0, 1, 2, 3) before 2026-11-28; a variable's was refused.
    model, opt = seeded_linear()
    state = {"counter": itertools.count(), "seen": []}

    def step(x):
        loss = minimize(opt, model(x).pow(2).mean())
        state["seen"].append(next(state["counter"]))
        return loss

    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(
        functacc.TraceError, match=r"draws from closure variable 'state'\['counter'\]"
    ):
        jitted(torch.randn(4, 3))
    assert state["seen"] == [] and next(state["counter"]) == 0 and not opt.state


def test_a_function_attribute_the_step_changes_is_a_clear_error_and_put_back() -> None:
    # step.calls = step.calls + 1 on the body itself: before 2026-11-28 made at the traces
    # only (2 after 4 calls), silently.
    model, opt = seeded_linear()

    def step(x):
        loss = minimize(opt, model(x).pow(2).mean())
        step.calls = getattr(step, "calls", 0) + 1
        return loss

    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"changes \.calls of function .*step: .*Fix"):
        jitted(torch.randn(4, 3))
    assert not hasattr(step, "calls") and not opt.state


class Logger:
    def __init__(self) -> None:
        self.logged = 0

    def log(self, loss: torch.Tensor) -> None:
        self.logged += 1


def bump(k: int, loss: torch.Tensor) -> None:
    CALLS["callback"] += k


@pytest.mark.parametrize("kind", ["partial", "bound method"])
def test_callbacks_held_in_a_list_keep_their_state_as_in_eager(kind: str) -> None:
    # functools.partial(bump, 2) and logger.log in a list of callbacks: before 2026-11-28
    # their writes were made at the traces only (4 vs 8; 2 vs 4), silently.
    runs = []
    for jit in (False, True):
        CALLS.update(callback=0)
        torch.manual_seed(0)
        model, logger = nn.Linear(3, 1), Logger()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hooks = [functools.partial(bump, 2)] if kind == "partial" else [logger.log]

        def step(x, model=model, opt=opt, hooks=hooks):
            loss = minimize(opt, model(x).pow(2).mean())
            for hook in hooks:
                hook(loss)
            return loss

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        for _ in range(4):
            step(torch.randn(4, 3))
        runs.append((CALLS["callback"], logger.logged))
    assert runs[1] == runs[0] == ((8, 0) if kind == "partial" else (0, 4))


class ClassCounted(nn.Module):
    """Counts its calls and keeps a scale on its class, as a registry or a shared schedule
    does: state of every instance, not of the model's tensors."""

    calls = 0
    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1  # the class never named
        return self.linear(x) * ClassCounted.scale


class Tally:
    total = 0.0


@pytest.mark.parametrize("front", ["jit", "compile_step"])
def test_class_attributes_the_step_reads_and_writes_are_eagers(front: str) -> None:
    # Before 2026-11-29 a module's class was not followed: its counter was bumped at each
    # trace only (2 after 4 calls, eager 4), silently, and a scale changed on the class
    # between calls stayed the trace's. A user class the body names (Tally) was followed.
    def run(compiled: bool) -> tuple[int, float, list[torch.Tensor]]:
        ClassCounted.calls, ClassCounted.scale, Tally.total = 0, 1.0, 0.0
        torch.manual_seed(0)
        model = ClassCounted()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = nn.functional.mse_loss

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = minimize(opt, loss_fn(model(x), y))
            Tally.total += loss.item()
            return loss.item()

        if compiled and front == "jit":
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
        elif compiled:  # the standard step: only the model's class in it
            step = functacc.compile_step(model, loss_fn, opt, backend="eager")
        g = torch.Generator().manual_seed(1)
        for i in range(4):
            ClassCounted.scale = 1.0 if i < 2 else 0.5
            step(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g))
        return ClassCounted.calls, Tally.total, [p.detach().clone() for p in model.parameters()]

    calls, total, params = run(compiled=False)
    jit_calls, jit_total, jit_params = run(compiled=True)
    assert calls == jit_calls == 4
    assert jit_total == (total if front == "jit" else 0.0)
    assert all(torch.equal(a, b) for a, b in zip(jit_params, params, strict=True))
