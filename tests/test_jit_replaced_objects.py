"""Objects a jitted body reads that code between calls replaces or changes: eager's choice.

A training loop switches objects between steps: a new learning-rate scheduler after the
warm-up (``scheduler = CosineAnnealingLR(opt, ...)``, stepped inside the step), another loss
for a second phase, another optimizer or model for the next stage, or a loss's setting
(``criterion.label_smoothing = 0.1``). Eager reads them afresh at every call. Before
2026-11-30 a jitted step kept what its trace had met: the old scheduler went on being
stepped (the new one never was), the old loss and its old setting stayed in the graph,
silently. Now such an object is guarded by identity where the body reads it (a closure
variable, a global, a dict entry, an attribute of a plain object), and a torch loss module
the body calls has its settings followed: another object or setting traces again.

On the eager backend every comparison is bit for bit: the same ops in the same order.
"""

from __future__ import annotations

import copy
import logging
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc


def batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def run(
    make: Callable[[], tuple[dict, Callable, list, list]],
    switch: Callable[[dict], None],
    jit: bool,
    at: int = 4,
    backend: str = "eager",
) -> tuple[list, dict, Any]:
    """``make()`` -> (its objects, the step body, modules, optimizers); ``switch`` runs
    between calls ``at - 1`` and ``at``."""
    env, body, modules, optimizers = make()
    step = (
        functacc.jit(body, modules=modules, optimizers=optimizers, backend=backend) if jit else body
    )
    out = []
    for i, (x, y) in enumerate(batches()):
        if i == at:
            switch(env)
        out.append(step(x, y))
    return out, env, step


def assert_as_eager(make: Callable, switch: Callable, traces: int) -> dict:
    (got, env, step), (expected, ref_env, _) = run(make, switch, True), run(make, switch, False)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), f"call {i}: {a} != {b}"
    for name in env["modules"]:
        for p, q in zip(env[name].parameters(), ref_env[name].parameters(), strict=True):
            assert torch.equal(p, q), name
    assert step.num_traces == traces, [t.reason for t in step.traces]
    return env


# -- a scheduler replaced after the warm-up, stepped inside the step -------------------------
def scheduler_body(where: str) -> Callable[[], tuple[dict, Callable, list, list]]:
    """The scheduler held by a closure variable, a dict entry or a trainer's attribute."""

    def make() -> tuple[dict, Callable, list, list]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
        env: dict[str, Any] = {"model": model, "opt": opt, "modules": ["model"]}
        holder: Any = types.SimpleNamespace(sched=warmup) if where == "attribute" else env
        if where == "dict":
            env["sched"] = warmup
        sched = warmup

        def body(x: torch.Tensor, y: torch.Tensor) -> list:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if where == "closure":
                sched.step()
            elif where == "dict":
                env["sched"].step()
            else:
                holder.sched.step()
            return [loss.detach(), opt.param_groups[0]["lr"]]

        def replace(new: Any) -> None:
            nonlocal sched
            sched = new
            if where == "dict":
                env["sched"] = new
            elif where == "attribute":
                holder.sched = new

        env["replace"] = replace
        env["current"] = lambda: {"closure": lambda: sched, "dict": lambda: env.get("sched")}.get(
            where, lambda: holder.sched
        )()
        return env, body, [model], [opt]

    return make


def to_cosine(env: dict) -> None:
    env["replace"](torch.optim.lr_scheduler.CosineAnnealingLR(env["opt"], T_max=4))


@pytest.mark.parametrize("where", ["closure", "dict", "attribute"])
def test_a_scheduler_replaced_after_the_warm_up_is_the_one_stepped(where: str):
    env = assert_as_eager(scheduler_body(where), to_cosine, traces=2)
    assert isinstance(env["current"](), torch.optim.lr_scheduler.CosineAnnealingLR)
    assert env["current"]().last_epoch == 4  # stepped by the last four calls


# -- a loss switched or changed --------------------------------------------------------------
def loss_body() -> tuple[dict, Callable, list, list]:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    env: dict[str, Any] = {"model": model, "modules": ["model"]}
    env["criterion"] = nn.CrossEntropyLoss()

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = env["criterion"](model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return env, body, [model], [opt]


def test_a_loss_replaced_between_calls_is_the_one_used():
    def switch(env: dict) -> None:
        env["criterion"] = nn.MultiMarginLoss()

    assert_as_eager(loss_body, switch, traces=2)


def test_a_setting_of_torchs_loss_changed_between_calls_is_followed():
    def switch(env: dict) -> None:
        env["criterion"].label_smoothing = 0.2

    assert_as_eager(loss_body, switch, traces=2)


# -- another optimizer, another model for the next stage -----------------------------------
def stages_body() -> tuple[dict, Callable, list, list]:
    """Stage 1 trains the head only; stage 2 the whole model with another optimizer; the
    current model (a student of two) and optimizer kept in variables of a trainer."""
    model, other = mlp(), mlp()
    head_opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    all_opt = torch.optim.Adam([*model.parameters(), *other.parameters()], lr=0.01)
    trainer = types.SimpleNamespace(model=model, opt=head_opt)
    env = {"model": model, "other": other, "modules": ["model", "other"], "trainer": trainer}
    env["all_opt"] = all_opt

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(trainer.model(x), y)
        trainer.opt.zero_grad()
        loss.backward()
        trainer.opt.step()
        return loss.detach()

    return env, body, [model, other], [head_opt, all_opt]


def test_the_next_stages_optimizer_and_model_are_the_ones_used():
    def next_stage(env: dict) -> None:
        env["trainer"].opt = env["all_opt"]
        env["trainer"].model = env["other"]

    # The first call; the second, where the body's gradients of the layers no optimizer of
    # stage 1 zeroes are inputs (they accumulate, as in eager); the next stage.
    assert_as_eager(stages_body, next_stage, traces=3)


def test_an_object_the_step_switches_itself_is_followed_call_by_call():
    # The body alternates its loss through a dict entry it reads and writes: each call
    # reads what the last one left, as eager does (one trace per object, reused).
    def make() -> tuple[dict, Callable, list, list]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mse, smooth = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.3)
        env: dict[str, Any] = {"model": model, "modules": ["model"], "criterion": mse}

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            criterion = env["criterion"]
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            env["criterion"] = smooth if criterion is mse else mse
            return loss.detach()

        return env, body, [model], [opt]

    assert_as_eager(make, lambda env: None, traces=2)


def test_a_forward_assigned_to_a_module_between_calls_is_the_one_run():
    # Code that patches a layer (model.head.forward = ...) after the step was built: the
    # module's attributes are those it had then, so this one is keyed on its own.
    def make() -> tuple[dict, Callable, list, list]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        return {"model": model, "modules": ["model"]}, body, [model], [opt]

    def patch(env: dict) -> None:
        head = env["model"][2]
        head.forward = lambda x: F.linear(x, head.weight, head.bias) * 0.5

    assert_as_eager(make, patch, traces=2)


# -- what a module keeps that is no setting of its forward: not a trace per call ------------
class Keeper(nn.Module):
    """A module that keeps its optimizer (Tent's ``self.optimizer``) and a dict keyed by its
    parameters (per-parameter statistics); neither is a setting its forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=0.01)
        self.seen = {p: 0 for p in self.net.parameters()}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.net(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def test_an_optimizer_or_a_dict_keyed_by_parameters_on_a_module_is_no_trace_per_call(
    caplog: pytest.LogCaptureFixture,
):
    # Before 2026-11-30 both were keyed by the parameters' printed values: traced again at
    # every call (a graph it had, with host time each time), silently.
    keeper, ref = Keeper(), Keeper()
    step = functacc.jit(keeper, modules=[keeper], optimizers=[keeper.optimizer], backend="eager")
    with caplog.at_level(logging.INFO, logger="functacc"):
        for x, y in batches():
            assert torch.equal(step(x, y), ref(x, y))
    traced = [r.message for r in caplog.records if "traced the jitted step" in r.message]
    assert len(traced) == 1 and "first call" in traced[0], traced


# -- objects the step makes ----------------------------------------------------------------
def reptile_body(copy_in_step: bool) -> Callable[[], tuple[dict, Callable, list, list]]:
    """Reptile's outer step: an inner copy of the model trained for two steps by an
    optimizer made in the step, then the model moved toward it. The copy made in the step
    (``copy.deepcopy``) or, as the error advises, made before and loaded in the step."""

    def make() -> tuple[dict, Callable, list, list]:
        model = mlp()
        kept = copy.deepcopy(model)

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if copy_in_step:
                inner = copy.deepcopy(model)
            else:
                inner = kept
                inner.load_state_dict(model.state_dict())
            inner_opt = torch.optim.SGD(inner.parameters(), lr=0.1)
            for k in range(2):
                loss = F.cross_entropy(inner(x[4 * k : 4 * k + 4]), y[4 * k : 4 * k + 4])
                inner_opt.zero_grad()
                loss.backward()
                inner_opt.step()
            with torch.no_grad():
                for p, q in zip(model.parameters(), inner.parameters(), strict=True):
                    p.add_(0.5 * (q - p))
            return loss.detach()

        return {"model": model, "modules": ["model"]}, body, [model, kept], []

    return make


def test_a_model_copied_in_the_step_is_a_clear_error_whose_advice_works():
    # Before 2026-11-30: "Mixing fake modes NYI". Followed on the eager backend for a while,
    # it trained wrongly under Inductor (losses off by 15% at the first call): refused.
    with pytest.raises(functacc.TraceError, match=r"copies its traced tensors.*load_state_dict"):
        run(reptile_body(True), lambda env: None, jit=True)
    got, env, _ = run(reptile_body(False), lambda env: None, jit=True)
    expected, ref_env, _ = run(reptile_body(True), lambda env: None, jit=False)
    assert all(map(torch.equal, got, expected))
    assert all(map(torch.equal, env["model"].parameters(), ref_env["model"].parameters()))


def lazy_body(kind: str, lazy: bool) -> Callable[[], tuple[dict, Callable, list, list]]:
    """A trainer that makes its EMA copy, or its optimizer, at the first step; or, as the
    error advises, before the first call."""

    def make() -> tuple[dict, Callable, list, list]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if kind == "ema" else None
        trainer = types.SimpleNamespace(ema=None, opt=None)

        def made() -> Any:
            if kind == "ema":
                return copy.deepcopy(model)
            return torch.optim.Adam(model.parameters(), lr=0.01)

        if not lazy:
            setattr(trainer, kind, made())

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if getattr(trainer, kind) is None:
                setattr(trainer, kind, made())
            optimizer = opt if kind == "ema" else trainer.opt
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if kind == "ema":
                with torch.no_grad():
                    for e, p in zip(trainer.ema.parameters(), model.parameters(), strict=True):
                        e.lerp_(p, 0.1)
            return loss.detach()

        env = {"model": model, "modules": ["model"], "trainer": trainer}
        modules = [model] + ([trainer.ema] if kind == "ema" and not lazy else [])
        optimizers = [opt] if kind == "ema" else ([trainer.opt] if not lazy else [])
        return env, body, modules, optimizers

    return make


@pytest.mark.parametrize("kind", ["ema", "opt"])
def test_a_module_or_optimizer_the_step_makes_and_keeps_is_a_clear_error_whose_advice_works(
    kind: str,
):
    # Before 2026-11-30 the optimizer made at the first call was kept as the trace's object:
    # losses off eager's from the third call, silently; the EMA copy failed with "Mixing fake
    # modes NYI".
    made_in_step = rf"trainer'\.{kind} is .* before the first" if kind == "opt" else "copies"
    with pytest.raises(functacc.TraceError, match=made_in_step):
        run(lazy_body(kind, lazy=True), lambda env: None, jit=True)
    got, env, _ = run(lazy_body(kind, lazy=False), lambda env: None, jit=True)
    expected, ref_env, _ = run(lazy_body(kind, lazy=True), lambda env: None, jit=False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    if kind == "ema":
        ema, ref_ema = env["trainer"].ema, ref_env["trainer"].ema
        assert all(map(torch.equal, ema.parameters(), ref_ema.parameters()))


def test_a_generator_replaced_between_calls_is_the_one_drawn_from():
    # Noise drawn from a torch.Generator the trainer keeps, made afresh for an epoch
    # (`trainer.gen = torch.Generator().manual_seed(epoch)`). Before 2026-11-30 the graph
    # went on drawing from the first one, silently: a new trace for the new object gave a
    # graph equal to the first, whose compile (holding the old generator) was reused.
    def make() -> tuple[dict, Callable, list, list]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = types.SimpleNamespace(gen=torch.Generator().manual_seed(7))

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            noise = torch.randn(x.shape, generator=trainer.gen) * 0.1
            loss = F.cross_entropy(model(x + noise), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        return {"model": model, "modules": ["model"], "trainer": trainer}, body, [model], [opt]

    def new_epoch(env: dict) -> None:
        env["trainer"].gen = torch.Generator().manual_seed(1)

    assert_as_eager(make, new_epoch, traces=2)


@pytest.mark.inductor
def test_a_replaced_scheduler_under_inductor():
    # Inductor fuses the float32 update and reassociates its sums: rounding, not more (a
    # stale scheduler moves the rate by 15% from the fifth call).
    got, env, _ = run(scheduler_body("closure"), to_cosine, True, backend="inductor")
    expected, ref_env, _ = run(scheduler_body("closure"), to_cosine, False)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
        assert a[1] == pytest.approx(b[1], rel=1e-12)
    for p, q in zip(env["model"].parameters(), ref_env["model"].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.inductor
@pytest.mark.xfail(
    strict=True,
    reason="found 2026-11-30, not fixed: an inner loop (weights loaded into a module of "
    "modules=, an optimizer made in the step stepped twice) compiled by Inductor gives "
    "losses off eager's by 0.14 at the first call (on f408f1d too); the eager backend agrees",
)
def test_reptiles_inner_loop_under_inductor():
    got, _, _ = run(reptile_body(False), lambda env: None, True, backend="inductor")
    expected, _, _ = run(reptile_body(False), lambda env: None, False)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
