"""Lightning Fabric's training loops through ``functacc.jit``, against eager.

The first loop is that of Lightning's ``examples/fabric/image_classifier/train_fabric.py``
(its ``Net``, Adadelta, ``fabric.setup``, ``fabric.backward(loss)``, the progress line printed
with ``loss.item()`` every ``log_interval`` batches, ``StepLR`` stepped per epoch, the test
loop summing ``F.nll_loss(..., reduction="sum").item()`` and updating a torchmetrics
``Accuracy``), on random MNIST-shaped data. The second adds what Fabric offers around the
step: ``bf16-mixed`` precision, accumulation under ``fabric.no_backward_sync``,
``fabric.clip_gradients`` and ``fabric.log`` to a ``CSVLogger``.

Before 2026-11-28 ``fabric.log(...)`` in the step wrote the trace's tokens into the CSV once
(``s30 + 1,zuf0``) and nothing on later calls, silently. With ``backend="eager"`` losses,
printed lines, logged rows and weights are compared bit for bit.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from lightning_fabric import Fabric, seed_everything
from lightning_fabric.loggers import CSVLogger
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import Accuracy

import functacc


class Net(nn.Module):
    """The example's network."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def loader(fabric: Fabric, seed: int, n: int = 24) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(
        torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    return fabric.setup_dataloaders(DataLoader(data, batch_size=8))


def image_classifier_run(jit: bool, epochs: int = 2, log_interval: int = 2) -> tuple:
    fabric = Fabric(accelerator="cpu", devices=1)
    seed_everything(1)
    train_loader, test_loader = loader(fabric, 0), loader(fabric, 1, 16)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    test_acc = Accuracy(task="multiclass", num_classes=10).to(fabric.device)
    test_loss = 0

    def train_step(data: torch.Tensor, target: torch.Tensor, epoch: int, batch_idx: int) -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        fabric.backward(loss)
        optimizer.step()
        if (batch_idx == 0) or ((batch_idx + 1) % log_interval == 0):
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}"
                f" ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
            )

    def test_step(data: torch.Tensor, target: torch.Tensor) -> None:
        nonlocal test_loss
        with torch.no_grad():
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            test_acc(output, target)

    if jit:
        train_step = functacc.jit(
            train_step, modules=[model], optimizers=[optimizer], backend="eager"
        )
        test_step = functacc.jit(test_step, modules=[model, test_acc], backend="eager")
    results = []
    for epoch in range(1, epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            train_step(data, target, epoch, batch_idx)
        scheduler.step()
        model.eval()
        test_loss = 0
        for data, target in test_loader:
            test_step(data, target)
        results.append((test_loss, test_acc.compute()))
        test_acc.reset()
    return results, [p.detach().clone() for p in model.parameters()]


def test_fabrics_image_classifier_example_runs_as_in_eager(capsys) -> None:
    eager = image_classifier_run(False)
    printed = capsys.readouterr().out
    jitted = image_classifier_run(True)
    assert capsys.readouterr().out == printed and printed.count("Train Epoch") == 4
    assert [r[0] for r in jitted[0]] == [r[0] for r in eager[0]]  # summed .item()s
    assert all(torch.equal(a[1], b[1]) for a, b in zip(jitted[0], eager[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))


def accumulating_run(jit: bool, root: pathlib.Path, backend: str = "eager") -> tuple:
    logger = CSVLogger(root, name="run")
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", loggers=logger)
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"step": 0}

    def train_step(x: torch.Tensor, y: torch.Tensor, i: int) -> float:
        is_accumulating = (i + 1) % 2 != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.cross_entropy(model(x), y) / 2
            fabric.backward(loss)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            fabric.log("train_loss", loss, step=state["step"])
            fabric.log_dict({"lr": optimizer.param_groups[0]["lr"], "half": loss / 2})
        return loss.item()

    if jit:
        train_step = functacc.jit(
            train_step, modules=[model], optimizers=[optimizer], backend="eager"
        )
    g = torch.Generator().manual_seed(1)
    losses = [
        train_step(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g), i)
        for i in range(6)
    ]
    logger.finalize("success")
    rows = (pathlib.Path(logger.log_dir) / "metrics.csv").read_text()
    return losses, [p.detach().clone() for p in model.parameters()], rows, state["step"]


def test_fabric_accumulation_clipping_and_logging_run_as_in_eager(tmp_path: pathlib.Path) -> None:
    eager = accumulating_run(False, tmp_path / "eager")
    jitted = accumulating_run(True, tmp_path / "jit")
    assert jitted[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))
    assert jitted[2] == eager[2] and eager[2].count("\n") == 7, jitted[2]  # header, 6 rows
    assert jitted[3] == eager[3] == 3


@pytest.mark.inductor
def test_fabric_logging_under_inductor(tmp_path: pathlib.Path) -> None:
    # Inductor's bf16 kernels round differently: the logged rows' steps exactly, values close.
    eager = accumulating_run(False, tmp_path / "eager")
    jitted = accumulating_run(True, tmp_path / "jit", backend="inductor")
    assert jitted[0] == pytest.approx(eager[0], rel=2e-2)
    rows = [[r.split(",") for r in run[2].splitlines()] for run in (eager, jitted)]
    assert rows[1][0] == rows[0][0] and len(rows[1]) == len(rows[0]) == 7
    for got, want in zip(rows[1][1:], rows[0][1:], strict=True):
        assert [v == "" for v in got] == [v == "" for v in want]
        assert [float(v) for v in got if v] == pytest.approx(
            [float(v) for v in want if v], rel=2e-2
        )
