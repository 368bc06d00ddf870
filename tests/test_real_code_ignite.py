"""PyTorch-Ignite's training loops through ``functacc.jit``, against eager.

Ignite runs a step function ``update(engine, batch)`` per iteration and reads its state
from the ``Engine`` it is given: ignite's own ``supervised_training_step`` (what
``create_supervised_trainer`` runs) accumulates gradients with
``if engine.state.iteration % gradient_accumulation_steps == 0: optimizer.step()``. Before
2026-11-28 the engine, an argument that is neither a tensor nor a number, was a constant of
the trace: ``engine.state.iteration`` read once, so with accumulation every later call did
what the first trace's iteration did (never stepped, or always), silently. An object argument
is now followed as a closure's object is: its numbers guarded, then fed once they change.
With ``backend="eager"`` losses, the engine's outputs and metrics and the weights are compared
bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events, supervised_training_step
from ignite.metrics import RunningAverage
from torch import nn

import functacc


def batches(n: int = 5) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def ignites_own_step(jit: dict | None, accumulate: int) -> tuple[list, nn.Module]:
    """ignite.engine.supervised_training_step as create_supervised_trainer uses it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    update = supervised_training_step(
        model, opt, nn.MSELoss(), gradient_accumulation_steps=accumulate
    )
    if jit is not None:
        update = functacc.jit(update, modules=model, optimizers=opt, **jit)
    trainer = Engine(update)
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    trainer.run(batches(), max_epochs=2)
    return outputs, model


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_ignites_supervised_training_step_with_accumulation_runs_as_in_eager(
    accumulate: int,
) -> None:
    got, model = ignites_own_step({"backend": "eager"}, accumulate)
    expected, reference = ignites_own_step(None, accumulate)
    assert got == expected and len(got) == 10
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.inductor
def test_ignites_supervised_training_step_under_inductor() -> None:
    got, model = ignites_own_step({}, 2)
    expected, reference = ignites_own_step(None, 2)
    assert got == pytest.approx(expected, rel=1e-5)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def own_update(jit: bool) -> tuple[list, nn.Module]:
    """A step of one's own over the engine's state: its epoch scales the loss, its iteration
    steps the scheduler; the output a dict a RunningAverage reads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)

    def train_step(engine: Engine, batch: tuple) -> dict:
        model.train()
        x, y = batch
        opt.zero_grad()
        loss = F.mse_loss(model(x), y) * (1.0 + 0.1 * engine.state.epoch)
        loss.backward()
        opt.step()
        if engine.state.iteration % 4 == 0:
            sched.step()
        return {"loss": loss.item(), "lr": opt.param_groups[0]["lr"]}

    if jit:
        train_step = functacc.jit(train_step, modules=model, optimizers=opt, backend="eager")
    trainer = Engine(train_step)
    RunningAverage(output_transform=lambda o: o["loss"]).attach(trainer, "avg")
    seen = []

    @trainer.on(Events.ITERATION_COMPLETED)
    def log(engine: Engine) -> None:
        seen.append((engine.state.iteration, engine.state.output, engine.state.metrics["avg"]))

    torch.manual_seed(5)  # the dropout masks
    trainer.run(batches(), max_epochs=3)
    return seen, model


def test_a_step_reading_the_engines_epoch_and_iteration_runs_as_in_eager() -> None:
    got, model = own_update(True)
    expected, reference = own_update(False)
    assert got == expected and len(got) == 15 and got[-1][1]["lr"] == 0.005
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
