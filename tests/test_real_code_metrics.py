"""torchmetrics updated inside a jitted training step, against eager.

The step is the one of lightning-hydra-template's ``MNISTLitModule``
(``src/models/mnist_module.py``): ``self.train_loss(loss)`` (a ``MeanMetric``) and
``self.train_acc(preds, targets)`` (``Accuracy(task="multiclass")``) in
``training_step``, the epoch's values from ``compute()`` and ``reset()`` between epochs,
``val_acc_best`` (a ``MaxMetric``) fed the validation accuracy. A metric is a module
whose forward writes Python attributes (``self._update_count += 1``, ``self._computed =
None``), rebinds its state tensors and clones their defaults from a private dict; its
aggregators check their input for NaN on the host.

Before 2026-11-28 such a step failed: a ``TraceError`` for the tensors of
``Metric._defaults``, then (given the metric in ``modules=``) a ``ValueError`` whose advice
(a registered buffer) a library's module cannot take, then a data-dependent branch in
``MeanMetric``'s NaN check. With ``backend="eager"`` losses, metric values, counters and
weights are compared bit for bit.
"""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import Accuracy, MulticlassAUROC, MulticlassF1Score

import functacc
from functacc import TraceError


class MNISTLitModule(pl.LightningModule):
    """lightning-hydra-template's module, its training and validation steps as written
    there (the network smaller, the data random)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.val_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: tuple) -> tuple:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        preds = torch.argmax(logits, dim=1)
        return loss, preds, y

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)


def batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g))
        for _ in range(n)
    ]


def lightning_run(backend: str | None, epochs: int = 2) -> tuple:
    """Lightning's automatic optimization of ``training_step`` by hand (the step's output,
    then zero_grad, backward and step), the epoch-end hooks outside the step."""
    torch.manual_seed(0)
    lit = MNISTLitModule(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10)))
    optimizer = torch.optim.Adam(lit.parameters(), lr=1e-2)

    def train_step(batch: tuple, batch_idx: int) -> torch.Tensor:
        loss = lit.training_step(batch, batch_idx)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    def val_step(batch: tuple, batch_idx: int) -> None:
        with torch.no_grad():
            lit.validation_step(batch, batch_idx)

    if backend is not None:
        train_step = functacc.jit(
            train_step, modules=[lit], optimizers=[optimizer], backend=backend
        )
        val_step = functacc.jit(val_step, modules=[lit], backend=backend)
    losses, epoch_values = [], []
    for epoch in range(epochs):
        lit.train()
        for i, batch in enumerate(batches(epoch, 4)):
            losses.append(train_step(batch, i))
        lit.eval()
        for i, batch in enumerate(batches(100 + epoch, 2)):
            val_step(batch, i)
        # on_validation_epoch_end, then what Lightning does with logged metric objects
        acc = lit.val_acc.compute()
        lit.val_acc_best(acc)
        metrics = (lit.train_loss, lit.train_acc, lit.val_loss, lit.val_acc, lit.val_acc_best)
        epoch_values.append([m.compute() for m in metrics] + [lit.train_acc._update_count])
        for metric in metrics[:4]:
            metric.reset()
    weights = [p.detach().clone() for p in lit.parameters()]
    traces = (len(train_step.traces), len(val_step.traces)) if backend else None
    return losses, epoch_values, weights, traces


def test_lightning_hydra_templates_training_step_with_metrics_runs_as_in_eager() -> None:
    eager = lightning_run(None)
    jitted = lightning_run("eager")
    assert all(torch.equal(a, b) for a, b in zip(jitted[0], eager[0], strict=True))
    for got, want in zip(jitted[1], eager[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got[:5], want[:5], strict=True)), got
        assert got[5] == want[5] == 4  # four updates per epoch, reset in between
    assert all(torch.equal(a, b) for a, b in zip(jitted[2], eager[2], strict=True))
    # The metrics' counters are fed, not guarded: the second trace of the training step is
    # for the gradients its first call left (zero_grad comes before backward), the second
    # of the validation step for batch_idx, fed from then on.
    assert jitted[3] == (2, 2)


@pytest.mark.inductor
def test_lightning_hydra_templates_training_step_with_metrics_under_inductor() -> None:
    eager = lightning_run(None, epochs=1)
    jitted = lightning_run("inductor", epochs=1)
    torch.testing.assert_close(jitted[0], eager[0], rtol=1e-5, atol=1e-6)
    # float32 kernels fused differently: the values, not their bits; counts exactly
    torch.testing.assert_close(jitted[1][0][:5], eager[1][0][:5], rtol=1e-5, atol=1e-6)
    assert jitted[1][0][5] == eager[1][0][5] == 4
    torch.testing.assert_close(jitted[2], eager[2], rtol=1e-5, atol=1e-6)


def metric_run(make: type | object, backend: str | None, style: str) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metric = make()

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple:
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if style == "forward":  # the batch's value, accumulated too
            return loss.detach(), metric(logits.detach(), y)
        metric.update(logits.detach(), y)
        return loss.detach(), None

    if backend is not None:
        step = functacc.jit(step, modules=[model, metric], optimizers=[opt], backend=backend)
    g = torch.Generator().manual_seed(1)
    outs = [
        step(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
        for _ in range(5)
    ]
    return outs, metric.compute(), [p.detach().clone() for p in model.parameters()]


METRICS = {
    "f1": lambda: MulticlassF1Score(num_classes=4, average="macro"),
    "collection": lambda: torchmetrics.MetricCollection(
        [Accuracy(task="multiclass", num_classes=4), MulticlassF1Score(num_classes=4)],
        compute_groups=False,
    ),
    # binned, with its argument checks off; its CPU test of whether predictions are
    # probabilities already is selected in the graph
    "auroc": lambda: MulticlassAUROC(num_classes=4, thresholds=5, validate_args=False),
    # unbinned: predictions and targets appended to list states on every call (a hash of
    # the metric, met by modules(), read those lists: an error before 2026-11-28)
    "auroc_unbinned": lambda: MulticlassAUROC(num_classes=4, validate_args=False),
}


# AUROC's forward computes the batch's value, whose compute() checks values on the host:
# the error test below.
CASES = [(n, "update") for n in METRICS] + [(n, "forward") for n in METRICS if "auroc" not in n]


@pytest.mark.parametrize(("name", "style"), CASES)
def test_metrics_updated_in_the_step_give_eagers_values(name: str, style: str) -> None:
    eager = metric_run(METRICS[name], None, style)
    jitted = metric_run(METRICS[name], "eager", style)
    flat = lambda v: list(v.values()) if isinstance(v, dict) else [v]  # noqa: E731
    for (loss, value), (ref_loss, ref_value) in zip(jitted[0], eager[0], strict=True):
        assert torch.equal(loss, ref_loss)
        if style == "forward":
            assert all(torch.equal(a, b) for a, b in zip(flat(value), flat(ref_value), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(flat(jitted[1]), flat(eager[1]), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(jitted[2], eager[2], strict=True))


def test_a_host_check_of_torchmetrics_is_an_error_whose_advice_works() -> None:
    # MulticlassAUROC checks its targets with torch.unique (validate_args=True) and its
    # compute() reads values on the host: the error names the fixes, and the first of them
    # (validate_args=False, compute() after the step) runs as eager does (test above).
    with pytest.raises(
        TraceError, match=r"(?s)torchmetrics.*validate_args=False.*compute\(\) after"
    ):
        metric_run(lambda: MulticlassAUROC(num_classes=4, thresholds=5), "eager", "update")
    with pytest.raises(TraceError, match=r"torchmetrics reads a tensor's value.*in _reduce_auroc"):
        metric_run(METRICS["auroc"], "eager", "forward")


def test_a_nan_in_a_mean_metric_fails_the_call_and_changes_nothing() -> None:
    # MeanMetric's default nan_strategy="warn" drops NaN values with a warning in eager, a
    # branch on their values. The check is in the graph: a call without NaN gives eager's
    # numbers (the Lightning test above), one with NaN fails before any state is written.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mean = MeanMetric()

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean(loss.detach())
        return loss.detach()

    jitted = functacc.jit(step, modules=[model, mean], optimizers=[opt], backend="eager")
    jitted(torch.ones(2, 4))
    before = ([p.clone() for p in model.parameters()], mean.mean_value.clone(), mean.weight.clone())
    with pytest.raises(RuntimeError, match=r"MeanMetric got NaN values.*nan_strategy='disable'"):
        jitted(torch.full((2, 4), float("nan")))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0], strict=True))
    assert torch.equal(mean.mean_value, before[1]) and torch.equal(mean.weight, before[2])
    assert mean._update_count == 1
    jitted(torch.ones(2, 4))
    assert mean._update_count == 2


def test_more_classes_than_declared_fail_the_call_as_in_eager_and_change_nothing() -> None:
    # Accuracy counts the distinct values of integer predictions and targets against
    # num_classes (len(torch.unique(t)) in eager): counted in the graph.
    def build() -> tuple:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = Accuracy(task="multiclass", num_classes=3)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y.clamp(max=2))
            opt.zero_grad()
            loss.backward()
            opt.step()
            acc(logits.argmax(1), y)
            return loss.detach()

        return model, acc, step, opt

    x, good, bad = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), torch.arange(8) % 5
    model, acc, step, _ = build()
    step(x, good)
    with pytest.raises(RuntimeError, match="more unique values in `target`"):
        step(x, bad)
    model, acc, step, opt = build()
    jitted = functacc.jit(step, modules=[model, acc], optimizers=[opt], backend="eager")
    jitted(x, good)
    before = [t.clone() for t in (*model.parameters(), acc.tp, acc.fp)]
    with pytest.raises(RuntimeError, match="more distinct values in `target` than expected"):
        jitted(x, bad)
    after = (*model.parameters(), acc.tp, acc.fp)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert acc._update_count == 1


def timm_meter_run(jit: bool, backend: str = "eager") -> tuple:
    # timm's train.py, train_one_epoch: losses_m = utils.AverageMeter(), then per batch
    # losses_m.update(loss.item(), input.size(0)) (a library object holding numbers).
    from timm.utils import AverageMeter

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses_m = AverageMeter()

    def step(input: torch.Tensor, target: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(model(input), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses_m.update(loss.item(), input.size(0))

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[optimizer], backend=backend)
    g = torch.Generator().manual_seed(1)
    for n in (8, 8, 8, 4):
        step(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return dict(vars(losses_m)), [p.detach().clone() for p in model.parameters()]


def test_timms_average_meter_updated_in_the_step_runs_as_in_eager() -> None:
    # Before 2026-11-28 the meter kept the trace's symbols (val = zuf0) and counted only the
    # traces' batches, silently: timm's objects were never followed.
    eager, jitted = timm_meter_run(False), timm_meter_run(True)
    assert jitted[0] == eager[0] and eager[0]["count"] == 28
    assert all(torch.equal(a, b) for a, b in zip(jitted[1], eager[1], strict=True))


@pytest.mark.inductor
def test_timms_average_meter_under_inductor() -> None:
    # The meter's count of batch sizes branched on, with a last batch of 4: fixed sizes.
    eager, jitted = timm_meter_run(False), timm_meter_run(True, "inductor")
    assert jitted[0]["count"] == eager[0]["count"] == 28
    assert jitted[0]["sum"] == pytest.approx(eager[0]["sum"], rel=1e-6)
    torch.testing.assert_close(jitted[1], eager[1], rtol=1e-5, atol=1e-6)


def test_a_library_object_left_holding_a_traced_value_is_an_error_that_changes_nothing() -> None:
    # A queue.Queue the step puts loss.item() into (for a logging thread): its code is not
    # followed, so the put would run once, at the trace, leaving a symbol in the queue
    # (before 2026-11-28, silently). Now a TraceError, the queue and the model as before;
    # its advice (put after the call what the step returns) runs.
    import queue

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: queue.Queue = queue.Queue()

    def step(x: torch.Tensor) -> float:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.put(loss.item())
        return loss.item()

    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(TraceError, match=r"left a value of its trace .* in .*losses'?\.queue"):
        jitted(torch.ones(2, 4))
    assert losses.qsize() == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))

    def fixed(x: torch.Tensor) -> float:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    jitted = functacc.jit(fixed, modules=[model], optimizers=[opt], backend="eager")
    for _ in range(2):
        losses.put(jitted(torch.ones(2, 4)))
    assert losses.qsize() == 2 and isinstance(losses.get(), float)
