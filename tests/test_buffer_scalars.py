"""A module's one-element buffer read with ``.item()`` and branched on, inside a jitted step.

Glow's ActNorm initializes its scale and shift from the first batch it sees, behind a flag
kept as a buffer (``if self.initialized.item() == 0: ... self.initialized.fill_(1)``); a
counter buffer gates work every few steps. Eager reads the number each call; functacc feeds
it to the graph and guards the branch (functacc.core.scalar_reads). On the eager backend
every number is compared bit for bit with eager's loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc


class ActNorm(nn.Module):
    """A data-initialized affine layer, as Glow implementations write it: a uint8 flag."""

    def __init__(self, channels: int):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(1, channels))
        self.scale = nn.Parameter(torch.ones(1, channels))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.initialized.item() == 0:
            with torch.no_grad():
                self.shift.data.copy_(-x.mean(0, keepdim=True))
                self.scale.data.copy_(1 / (x.std(0, keepdim=True) + 1e-6))
            self.initialized.fill_(1)
        return self.scale * (x + self.shift)


class Every(nn.Module):
    """Adds a penalty every ``k`` calls, counted in a buffer (a schedule kept in state)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.register_buffer("calls", torch.tensor(0))

    def forward(self, loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        n = int(self.calls.item())
        self.calls += 1
        return loss + weight.square().sum() if n % self.k == 0 else loss


def flow(seed: int = 0) -> tuple[nn.Module, Every, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), ActNorm(6), nn.Tanh(), nn.Linear(6, 1))
    every = Every(3)
    return model, every, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(8, 5, generator=g) * 3 + 1, torch.randn(8, 1, generator=g)) for _ in range(n)
    ]


def train(jit: str | None, n: int = 8) -> tuple[list[float], nn.Module, Every, int]:
    model, every, opt = flow()

    def body(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = every(F.mse_loss(model(x), y), model[0].weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    step = body
    if jit is not None:
        step = functacc.jit(body, modules=[model, every], optimizers=[opt], backend=jit)
    losses = [step(x, y) for x, y in batches(n)]
    return losses, model, every, len(step.traces) if jit else 0


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_flags_and_counters_in_buffers_branch_as_in_eager(backend: str) -> None:
    # Before 2026-11-28 a TraceError ("Python code cannot branch on tensor values"): the
    # advice, a torch.where, cannot express a data-dependent initialization.
    eager_losses, eager_model, eager_every, _ = train(None)
    losses, model, every, traces = train(backend)
    # the first call initializes (a trace that branched, then one fed); the counter's
    # branch adds n % 3 == 0 and != 0 once each: not one trace per value
    assert traces <= 3 and int(every.calls) == int(eager_every.calls) == 8
    assert int(model[1].initialized) == 1
    pairs = list(zip(model.state_dict().values(), eager_model.state_dict().values(), strict=True))
    if backend == "eager":
        assert losses == eager_losses
        assert all(torch.equal(a, b) for a, b in pairs)
    else:  # Inductor fuses the arithmetic: float32 rounding
        torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_more_calls_reuse_the_traces() -> None:
    _, _, _, after_eight = train("eager", 8)
    _, _, _, after_twenty = train("eager", 20)
    assert after_twenty == after_eight


def test_a_flag_written_through_data_then_read_again_is_an_error_that_changes_nothing() -> None:
    # The number is followed through whole-number increments only: read again after a
    # write it cannot follow (here through .data), it is unknown, and a branch on it is a
    # TraceError naming the line, as before; the model is left as it was.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model.register_buffer("flag", torch.tensor(False))

    def body(x: torch.Tensor) -> torch.Tensor:
        if not model.flag.item():
            model.flag.data.fill_(True)
        if model.flag.item():  # eager: always True here
            return model(x).sum()
        return model(x).mean()

    step = functacc.jit(body, modules=[model], backend="eager")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(functacc.TraceError, match=r"if model\.flag\.item\(\)"):
        step(torch.ones(2, 3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class CountsCalls(nn.Module):
    """tests/test_errors.py's model that counts its calls in a Python attribute (an error
    advising a registered buffer), written as that advice says."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.layer(x) * (2.0 if self.calls > 2 else 1.0)


@pytest.mark.parametrize("door", ["compile_step", "jit"])
def test_the_attribute_errors_advice_a_counting_buffer_works(door: str) -> None:
    # Before 2026-11-28 the advised buffer was a TraceError as soon as the forward
    # branched on it (`self.calls > 2` is a tensor): the advice did not work.
    def run(door: str | None) -> tuple[list[float], torch.Tensor, int, int]:
        torch.manual_seed(0)
        model = CountsCalls()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 2)

        def body(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()

        if door == "compile_step":
            step = functacc.compile_step(model, nn.MSELoss(), opt, backend="eager")
            losses = [step(x, y).item() for _ in range(6)]
        else:
            step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
            losses = [(step if door else body)(x, y) for _ in range(6)]
        traces = len(step.traces) if door else 0
        return losses, model.layer.weight.detach().clone(), int(model.calls), traces

    eager, compiled = run(None), run(door)
    assert compiled[0] == eager[0] and torch.equal(compiled[1], eager[1])
    assert compiled[2] == eager[2] == 6 and compiled[3] <= 2  # calls <= 2, then > 2
