"""kuangliu/pytorch-cifar's training loop through ``functacc.jit``, against eager.

``main.py``'s ``train(epoch)`` (commit 49b7aa9), its loop body made the jitted step (a
nested function, ``nonlocal`` totals), on random CIFAR-shaped data and its ``LeNet``: SGD with
momentum and weight decay, ``train_loss += loss.item()``, ``correct += ...sum().item()``, and
``utils.progress_bar(batch_idx, len(trainloader), 'Loss: %.3f | Acc: ...' % (...))`` every
batch (tests/kuangliu_utils.py: a bar of ``int(65 * current / total)`` marks, the clock in
globals, times formatted with branches).

Before 2026-11-28 the bar went wrong silently: its branches on the clock were checked with
one reading of the clock and traced with another, so a program was kept under branches its
trace had not taken, and later calls reused it (the bar stuck at one length, the last line's
newline missing). The clock is now read once per call. As written, the step still traces
again on every call (the bar's length is a branch); the warning says to wrap the bar with
``functacc.host``, which runs it after each call: one trace, eager's output to the byte.
"""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Callable

import kuangliu_utils
import pytest
import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

import functacc
from functacc.errors import TraceError


class LeNet(nn.Module):
    """models/lenet.py, as written."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x))
        out = F.max_pool2d(out, 2)
        out = F.relu(self.conv2(out))
        out = F.max_pool2d(out, 2)
        out = out.view(out.size(0), -1)
        out = F.relu(self.fc1(out))
        out = F.relu(self.fc2(out))
        return self.fc3(out)


def run_script(
    batches: int, epochs: int, jit: dict | None, progress_bar: Callable
) -> tuple[list, LeNet, list]:
    """main.py's model, optimizer and train(epoch), for ``epochs`` epochs; ``jit``: the
    loop body through functacc.jit with these options, else eager."""
    torch.manual_seed(0)
    net = LeNet()
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    g = torch.Generator().manual_seed(1)
    n = 8 * batches
    data = TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    trainloader = DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    steps = []

    def train(epoch: int) -> tuple:
        print("\nEpoch: %d" % epoch)  # noqa: UP031
        net.train()
        train_loss = 0
        correct = 0
        total = 0

        def step(batch_idx, inputs, targets):
            nonlocal train_loss, correct, total
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()

            train_loss += loss.item()
            _, predicted = outputs.max(1)
            total += targets.size(0)
            correct += predicted.eq(targets).sum().item()

            progress_bar(batch_idx, len(trainloader), 'Loss: %.3f | Acc: %.3f%% (%d/%d)'  # noqa: UP031
                         % (train_loss/(batch_idx+1), 100.*correct/total, correct, total))  # fmt: skip  # noqa: E501

        if jit is not None:
            step = functacc.jit(step, modules=net, optimizers=optimizer, **jit)
            steps.append(step)
        for batch_idx, (inputs, targets) in enumerate(trainloader):
            step(batch_idx, inputs, targets)
        return train_loss, correct, total

    totals = []
    for epoch in range(epochs):
        totals.append(train(epoch))
        scheduler.step()
    return totals, net, steps


def fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """utils.py's clock, advancing 0.25 s a read: eager's and the jitted run's bars read
    the same times when the bar runs on the host both times."""
    now = iter(1000.0 + 0.25 * k for k in range(10**6))
    monkeypatch.setattr(kuangliu_utils, "time", types.SimpleNamespace(time=lambda: next(now)))


def without_times(text: str) -> str:
    """The bar's text without its times (and the padding whose width they set)."""
    text = re.sub(r"  Step: \S+ \| Tot: \S+", "", text)
    return re.sub(r" *\x08+", "<back>", text)


def test_the_progress_bar_as_written_draws_eagers_bars_and_the_warning_says_what_works(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    bar = kuangliu_utils.progress_bar
    eager, eager_net, _ = run_script(10, 1, None, bar)
    eager_out = capsys.readouterr().out
    with caplog.at_level(logging.WARNING, logger="functacc"):
        jitted, net, _ = run_script(10, 1, {"backend": "eager"}, bar)
    out = capsys.readouterr().out
    assert jitted == eager  # train_loss, correct, total: the same numbers, summed alike
    for a, b in zip(net.parameters(), eager_net.parameters(), strict=True):
        assert torch.equal(a, b)
    assert without_times(out) == without_times(eager_out)
    assert out.count("=") == eager_out.count("=") == sum(int(65 * k / 10) for k in range(10))
    assert out.endswith(" 10/10 \n")
    # Each call's bar length is a branch of its own: a trace per call, said, with the fix.
    warned = [r.getMessage() for r in caplog.records if "branch on fed numbers" in r.getMessage()]
    assert warned, "the retraces on the bar's branches are not named"
    assert "progress_bar = functacc.host(progress_bar)" in warned[-1]
    assert "kuangliu_utils.py:" in warned[-1]  # the lines (in progress_bar or format_time)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_the_progress_bar_run_on_the_host_prints_eagers_text_with_one_trace(
    backend: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    epochs, batches = (2, 6) if backend == "eager" else (1, 4)
    fake_clock(monkeypatch)
    eager, eager_net, _ = run_script(batches, epochs, None, kuangliu_utils.progress_bar)
    eager_out = capsys.readouterr().out
    fake_clock(monkeypatch)
    bar = functacc.host(kuangliu_utils.progress_bar)
    jitted, net, steps = run_script(batches, epochs, {"backend": backend}, bar)
    out = capsys.readouterr().out
    # Per epoch: the first call (batch_idx 0), then batch_idx fed; no trace per bar.
    assert [len(s.traces) for s in steps] == [2] * epochs
    assert all(s._engine.engine.reused == 0 for s in steps)
    if backend == "eager":  # the same kernels: the same bits, the same text
        assert jitted == eager
        assert out == eager_out
        for a, b in zip(net.parameters(), eager_net.parameters(), strict=True):
            assert torch.equal(a, b)
        return
    # Inductor's fused float32 kernels: losses to rounding (3 printed decimals), counts equal.
    losses = [float(x) for x in re.findall(r"Loss: (\S+)", out)]
    eager_losses = [float(x) for x in re.findall(r"Loss: (\S+)", eager_out)]
    assert losses == pytest.approx(eager_losses, abs=1.5e-3)
    assert re.sub(r"Loss: \S+", "", out) == re.sub(r"Loss: \S+", "", eager_out)
    assert [t[1:] for t in jitted] == [t[1:] for t in eager]
    assert jitted[0][0] == pytest.approx(eager[0][0], rel=1e-5)
    for a, b in zip(net.parameters(), eager_net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_host_function_gets_the_calls_values_and_its_result_is_refused_in_the_step() -> None:
    seen = []

    def note(step: int, loss: torch.Tensor, value: float, text: str) -> int:
        seen.append((step, loss.clone(), value, text))
        return len(seen)

    def body(model: nn.Linear, opt: optim.Optimizer, show: Callable) -> Callable:
        def step(i, x):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            show(i, loss.detach(), loss.item() * 2, f"step {i}: {loss.item():.5f}")
            return loss.detach()

        return step

    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    torch.manual_seed(0)
    model, runs = nn.Linear(3, 1), []
    for show in (note, functacc.host(note)):
        model_k = nn.Linear(3, 1)
        model_k.load_state_dict(model.state_dict())
        opt = optim.SGD(model_k.parameters(), lr=0.1)
        step = body(model_k, opt, show)
        if show is not note:
            step = functacc.jit(step, modules=model_k, optimizers=opt, backend="eager")
        losses = [step(i, x) for i, x in enumerate(xs)]
        runs.append((losses, list(seen), model_k.weight.detach().clone()))
        seen.clear()
    (eager_losses, eager_seen, eager_w), (losses, got, w) = runs
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    assert torch.equal(w, eager_w)
    assert [(s, v, t) for s, _, v, t in got] == [(s, v, t) for s, _, v, t in eager_seen]
    for (_, a, _, _), (_, b, _, _) in zip(got, eager_seen, strict=True):
        assert torch.equal(a, b)

    # A step that uses what a host function returns: an error before anything changed.
    model = nn.Linear(3, 1)
    opt = optim.SGD(model.parameters(), lr=0.1)
    counted = functacc.host(note)

    def uses_it(x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if counted(0, loss.detach(), 0.0, "") > 2:
            print("more than two")

    before = model.weight.detach().clone()
    with pytest.raises(TraceError, match=r"uses the result of .*note\(\), a functacc.host"):
        functacc.jit(uses_it, modules=model, optimizers=opt, backend="eager")(xs[0])
    assert torch.equal(model.weight, before) and not seen and not opt.state


# yunjey/pytorch-tutorial (commit 0500d3d), tutorials/01-basics/feedforward_neural_network:
# the loop body as the step, its progress line printed with str.format every 100th step
# (here every 3rd of 7 per epoch). The branch is the step's own code: two outcomes, so a few
# traces in all, and the warning does not advise functacc.host.
def feedforward_tutorial(jit: bool, caplog: pytest.LogCaptureFixture) -> tuple[list, nn.Module]:
    torch.manual_seed(0)
    input_size, hidden_size, num_classes, num_epochs, total_step = 784, 50, 10, 2, 7

    class NeuralNet(nn.Module):
        def __init__(self, input_size, hidden_size, num_classes):
            super().__init__()
            self.fc1 = nn.Linear(input_size, hidden_size)
            self.relu = nn.ReLU()
            self.fc2 = nn.Linear(hidden_size, num_classes)

        def forward(self, x):
            out = self.fc1(x)
            out = self.relu(out)
            out = self.fc2(out)
            return out

    model = NeuralNet(input_size, hidden_size, num_classes)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)

    def step(epoch, i, images, labels):
        images = images.reshape(-1, 28 * 28)
        outputs = model(images)
        loss = criterion(outputs, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (i + 1) % 3 == 0:
            print(
                "Epoch [{}/{}], Step [{}/{}], Loss: {:.4f}".format(  # noqa: UP032 (as written)
                    epoch + 1, num_epochs, i + 1, total_step, loss.item()
                )
            )

    if jit:
        step = functacc.jit(step, modules=model, optimizers=optimizer, backend="eager")
    g = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="functacc"):
        for epoch in range(num_epochs):
            for i in range(total_step):
                images = torch.rand(16, 1, 28, 28, generator=g)
                step(epoch, i, images, torch.randint(0, 10, (16,), generator=g))
    return [r.getMessage() for r in caplog.records], model


def test_yunjeys_tutorial_prints_with_format_as_in_eager(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    _, reference = feedforward_tutorial(False, caplog)
    eager_out = capsys.readouterr().out
    warned, model = feedforward_tutorial(True, caplog)
    assert capsys.readouterr().out == eager_out and eager_out.count("\n") == 4
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    branch = [w for w in warned if "branch on fed numbers" in w]
    assert branch and all("(the step)" in w and "functacc.host" not in w for w in branch)
