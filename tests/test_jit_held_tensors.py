"""The step's own tensors where Python holds them outside the modules, as trainers keep them.

Real training code keeps its parameters in lists taken before the loop
(``params = list(model.parameters())`` for clipping and logging), under two names
(improved-diffusion's ``self.master_params = self.model_params``), and copies them for an
EMA with ``copy.deepcopy`` (parameters that require grad, updated in place under
``detach()``). Before 2026-11-29 ``functacc.jit`` left the real parameters in those lists
while it traced: ``clip_grad_norm_(params, ...)`` found no gradients there and clipped
nothing, silently; ``p.grad`` read through the list was ``None``; the EMA copies were
refused. Reference: the same body run eagerly, compared bit for bit (rtol=atol=0) on the
eager backend (the same ATen kernels on the same values in the same order); one case runs
under Inductor (rtol 1e-5: float32 reassociation of fused kernels).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import functacc

STEPS = 4


def batches(n: int = STEPS) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


class ListTrainer:
    """Parameters in a list taken before the loop: an L2 penalty summed over it (with
    ``l2``), the gradients clipped through it (to a norm the step reaches: clipping acts),
    and their norm logged from ``.grad`` read through it (with ``log``)."""

    def __init__(self, l2: bool = True, log: bool = True) -> None:
        self.l2, self.log = l2, log
        self.model = mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.params = list(self.model.parameters())
        self.norms: list[float] = []

    def step(self, x: Tensor, y: Tensor) -> tuple[float, float]:
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        if self.l2:
            loss = loss + 1e-2 * sum(p.square().sum() for p in self.params)
        loss.backward()
        before = torch.nn.utils.clip_grad_norm_(self.params, 0.05)
        if self.log:
            self.norms.append(sum((p.grad**2).sum().item() for p in self.params))
        self.opt.step()
        return loss.item(), before.item()

    def state(self) -> Any:
        return self.norms


class DiffusionTrainer:
    """improved-diffusion's ``TrainLoop`` (openai/improved-diffusion, ``train_util.py``),
    reduced to its Python: the parameter list under two names, gradients zeroed by hand
    through it, micro-batches, the gradient norm logged as ``np.sqrt`` of a sum of
    ``.item()`` s (a NumPy float64), the learning rate annealed from ``self.step``, and
    two EMAs of ``copy.deepcopy``-ed parameters updated in place."""

    def __init__(self) -> None:
        self.model = mlp()
        self.model_params = list(self.model.parameters())
        self.master_params = self.model_params
        self.lr, self.anneal_steps, self.step = 0.05, 10, 0
        self.opt = torch.optim.AdamW(self.master_params, lr=self.lr)
        self.ema_rate = [0.9, 0.99]
        self.ema_params = [copy.deepcopy(self.master_params) for _ in self.ema_rate]
        self.logged: dict[str, Any] = {}

    def run_step(self, x: Tensor, y: Tensor) -> None:
        for p in self.model_params:  # the script's own zero_grad(model_params)
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()
        for i in range(0, x.shape[0], 3):
            loss = F.mse_loss(self.model(x[i : i + 3]), y[i : i + 3])
            self.logged["loss"] = loss.item()
            loss.backward()
        sqsum = 0.0
        for p in self.master_params:
            sqsum += (p.grad**2).sum().item()
        self.logged["grad_norm"] = np.sqrt(sqsum)
        lr = self.lr * (1 - self.step / self.anneal_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for rate, params in zip(self.ema_rate, self.ema_params, strict=True):
            for target, source in zip(params, self.master_params, strict=True):
                target.detach().mul_(rate).add_(source, alpha=1 - rate)

    def state(self) -> Any:
        return dict(self.logged), [[t.detach().clone() for t in ps] for ps in self.ema_params]


def train(make: Callable, backend: str | None) -> tuple[list, Any, Any]:
    trainer = make()
    body = trainer.run_step if isinstance(trainer, DiffusionTrainer) else trainer.step
    step = body
    if backend is not None:
        step = functacc.jit(
            body, modules=[trainer.model], optimizers=[trainer.opt], backend=backend
        )
    outs, states = [], []
    for x, y in batches():
        outs.append(step(x, y))
        states.append(trainer.state())
        if isinstance(trainer, DiffusionTrainer):
            trainer.step += 1
    return outs, states, trainer


def assert_equal(actual: Any, expected: Any, rtol: float = 0.0) -> None:
    if isinstance(expected, Tensor):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_equal(a, e, rtol)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for k in expected:
            assert_equal(actual[k], expected[k], rtol)
    else:
        assert type(actual) is type(expected), (actual, expected)  # np.float64 stays one
        if rtol and isinstance(expected, float):
            assert actual == pytest.approx(expected, rel=rtol, abs=0), (actual, expected)
        else:
            assert actual == expected, (actual, expected)


class NamedTrainer:
    """``list(model.named_parameters())`` taken before the loop (pairs: the parameter in a
    tuple), each gradient's norm logged by name where it exists, and the gradients halved
    in place through a list of the trainable ones, the optimizer's own list. Before
    2026-11-29 ``p.grad`` was ``None`` there: nothing logged, silently."""

    def __init__(self) -> None:
        self.model = mlp()
        self.named = list(self.model.named_parameters())
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.trainable, lr=0.01)
        self.log: list[tuple[str, float]] = []

    def step(self, x: Tensor, y: Tensor) -> float:
        self.opt.zero_grad()
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        for name, p in self.named:
            if p.grad is not None:
                self.log.append((name, p.grad.norm().item()))
        for p in self.trainable:
            p.grad /= 2
        self.opt.step()
        return loss.item()

    def state(self) -> Any:
        return list(self.log)


def clipping_only() -> ListTrainer:
    """Before 2026-11-29 this one trained unclipped, silently (no error)."""
    return ListTrainer(l2=False, log=False)


@pytest.mark.parametrize(
    "make",
    [ListTrainer, clipping_only, NamedTrainer, DiffusionTrainer],
    ids=["list", "clip", "named", "diffusion"],
)
def test_parameters_held_outside_the_modules_train_as_eager(make: Callable) -> None:
    eager, jitted = train(make, None), train(make, "eager")
    assert_equal(jitted[0], eager[0])
    assert_equal(jitted[1], eager[1])
    for p, q in zip(jitted[2].model.parameters(), eager[2].model.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
    if make in (ListTrainer, clipping_only):  # clipping acted (the norm before it > 0.05)
        assert all(before > 0.05 for _, before in eager[0])
    if make is NamedTrainer:  # every gradient logged, each call
        assert len(eager[1][-1]) == 4 * STEPS


def test_parameter_list_under_inductor() -> None:
    eager, jitted = train(ListTrainer, None), train(ListTrainer, "inductor")
    assert_equal(jitted[0], eager[0], rtol=1e-5)
    assert_equal(jitted[1], eager[1], rtol=1e-5)
    for p, q in zip(jitted[2].model.parameters(), eager[2].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_list_held_under_two_names_is_one_list() -> None:
    """Appended through one name and read through the other: as for one name, a
    TraceError (the length read would be fixed at the trace); before 2026-11-29 the other
    name kept the original list, read empty at every call, silently."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = type("Trainer", (), {})()
    trainer.history = history = []
    trainer.log = trainer.history

    def body(x: Tensor, y: Tensor) -> int:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        trainer.history.append(loss.item())
        return len(trainer.log)

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(functacc.TraceError, match=r"reads the list .*history"):
        step(*batches(1)[0])
    # Put back as it was: the same list under both names (before 2026-11-29 a failed
    # trace left a copy under each).
    assert trainer.history is history and trainer.log is history and history == []
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_held_tensor_that_backward_reaches_is_refused() -> None:
    """A tensor that requires grad, held by a variable, given to no optimizer: eager's
    backward accumulates into its ``.grad``, which a graph input cannot keep."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.ones(2, requires_grad=True)

    def body(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x) * scale, y)
        loss.backward()
        opt.step()
        return loss

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    before = [p.detach().clone() for p in model.parameters()]
    message = r"backward\(\) computed a gradient for the tensor at .*scale.*modules=\(\.\.\.\)"
    with pytest.raises(functacc.TraceError, match=message):
        step(*batches(1)[0])
    assert scale.grad is None and torch.equal(scale, torch.ones(2))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters()) and not opt.state


@pytest.mark.parametrize("into", ["reached", "made"])
def test_key_formatted_from_a_computed_number_is_refused(into: str) -> None:
    """improved-diffusion logs each sample's loss under its timestep's quartile,
    ``f"{key}_q{quartile}"`` with ``quartile`` from the timesteps' values: which entry
    eager writes, and how many entries there are, follow the values. Into a dict the step
    reaches, or one it makes and keeps: before 2026-11-29 the trace's stand-in stayed the
    key, one new entry per sample and call, silently (printed as ``'loss_q\\x00...'``)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    means: dict[str, float] = {}
    kept: list[dict] = []

    def body(x: Tensor, y: Tensor) -> None:
        opt.zero_grad()
        losses = ((model(x) - y) ** 2).mean(1)
        losses.mean().backward()
        opt.step()
        timesteps = (y[:, 0].abs() * 3).long()
        logged = means if into == "reached" else {}
        for t, value in zip(timesteps.numpy(), losses.detach().numpy(), strict=True):
            quartile = int(4 * t / 10)
            logged[f"loss_q{quartile}"] = float(value)
        kept.append(logged)

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    where = "the dict at .*means" if into == "reached" else "a dict the step makes"
    with pytest.raises(functacc.TraceError, match=rf"'loss_q\{{\.\.\.\}}' as a key of {where}"):
        step(*batches(1)[0])
    assert means == {} and kept == []


def test_parameter_list_held_too_deep_is_refused() -> None:
    """A parameter list four attributes deep from the step's variables, past where
    ``jit`` follows Python state: its ``.grad`` would be the real parameter's (``None``
    here: ``clip_grad_norm_`` would clip nothing), so reading it is a TraceError naming the
    parameter, with nothing changed."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deep = types.SimpleNamespace(params=list(model.parameters()))
    for _ in range(3):
        deep = types.SimpleNamespace(inner=deep)
    config = deep

    def body(x: Tensor, y: Tensor) -> float:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(config.inner.inner.inner.params, 0.01)
        opt.step()
        return norm.item()

    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(functacc.TraceError, match=r"\.grad of the parameter .*weight itself"):
        step(*batches(1)[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
