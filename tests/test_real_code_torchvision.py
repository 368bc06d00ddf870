"""torchvision's classification recipe (references/classification/train.py and utils.py)
through ``functacc.jit``, against eager: one iteration of ``train_one_epoch`` as the step,
its EMA an ``AveragedModel`` subclass updated every ``model_ema_steps`` iterations and reset
during warm-up, its accuracy and meters in Python.

Before, the EMA's ``update_parameters`` was a TraceError (``AveragedModel`` branches on
``n_averaged``), whose advice was to move the update out of the step. With
``backend="eager"`` losses, weights, averages and meters are compared bit for bit.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict, deque

import pytest
import torch
import torchvision
from torch import nn

import functacc


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """utils.ExponentialMovingAverage, as the recipe (and the projects copying it) write it."""

    def __init__(self, model: nn.Module, decay: float, device: str = "cpu") -> None:
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


class SmoothedValue:
    """utils.SmoothedValue: a window of values and the global sums."""

    def __init__(self, window_size: int = 20) -> None:
        self.deque: deque = deque(maxlen=window_size)
        self.total, self.count = 0.0, 0

    def update(self, value: float, n: int = 1) -> None:
        self.deque.append(value)
        self.count += n
        self.total += value * n


class MetricLogger:
    """utils.MetricLogger's update: tensors read with .item(), meters made on first use."""

    def __init__(self) -> None:
        self.meters: defaultdict = defaultdict(SmoothedValue)

    def update(self, **kwargs: object) -> None:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            assert isinstance(v, (float, int))
            self.meters[k].update(v)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple = (1,)) -> list:
    """utils.accuracy."""
    with torch.inference_mode():
        maxk = max(topk)
        batch_size = target.size(0)
        if target.ndim == 2:
            target = target.max(dim=1)[1]
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target[None])
        res = []
        for k in topk:
            correct_k = correct[:k].flatten().sum(dtype=torch.float32)
            res.append(correct_k * (100.0 / batch_size))
        return res


def recipe_run(jit: bool, backend: str = "eager", epochs: int = 2, per_epoch: int = 4) -> tuple:
    torch.manual_seed(0)
    model = torchvision.models.resnet.ResNet(
        torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10
    )
    args = types.SimpleNamespace(
        model_ema_steps=2, lr_warmup_epochs=1, clip_grad_norm=1.0, epochs=epochs, batch_size=6
    )
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        schedulers=[
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=1),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs - 1),
        ],
        milestones=[1],
    )
    adjust = 1 * args.batch_size * args.model_ema_steps / args.epochs
    alpha = min(1.0, (1.0 - 0.99998) * adjust)
    model_ema = ExponentialMovingAverage(model, device="cpu", decay=1.0 - alpha)
    metric_logger = MetricLogger()

    def iteration(i: int, image: torch.Tensor, target: torch.Tensor, epoch: int) -> None:
        # train_one_epoch's loop body (the clock meter left out: a clock read in the step is
        # an error of its own, tests/test_real_code.py).
        output = model(image)
        optimizer.zero_grad()
        loss = criterion(output, target)
        loss.backward()
        if args.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                # Reset ema buffer to keep copying weights during warmup period
                model_ema.n_averaged.fill_(0)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        batch_size = image.shape[0]
        metric_logger.update(loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
        metric_logger.meters["acc1"].update(acc1.item(), n=batch_size)
        metric_logger.meters["acc5"].update(acc5.item(), n=batch_size)

    modules = [model, model_ema]
    step = functacc.jit(iteration, modules=modules, optimizers=[optimizer], backend=backend)
    g = torch.Generator().manual_seed(1)
    history = []
    for epoch in range(epochs):
        model.train()
        for i in range(per_epoch):
            image = torch.randn(args.batch_size, 3, 32, 32, generator=g)
            target = torch.randint(0, 10, (args.batch_size,), generator=g)
            (step if jit else iteration)(i, image, target, epoch)
            history.append((int(model_ema.n_averaged), metric_logger.meters["loss"].deque[-1]))
        lr_scheduler.step()
    meters = {k: (list(m.deque), m.total, m.count) for k, m in metric_logger.meters.items()}
    state = [t.detach().clone() for t in (*model.state_dict().values(),)]
    averaged = [t.detach().clone() for t in model_ema.state_dict().values()]
    return history, meters, state, averaged, step


def test_torchvision_recipe_with_its_ema_trains_as_in_eager() -> None:
    history, meters, state, averaged, step = recipe_run(jit=True)
    ref_history, ref_meters, ref_state, ref_averaged, _ = recipe_run(jit=False)
    assert history == ref_history
    # warm-up resets n_averaged to 0 after each update (each copies); then it counts
    assert [n for n, _ in history] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert meters == ref_meters and set(meters) == {"loss", "lr", "acc1", "acc5"}
    assert all(torch.equal(a, b) for a, b in zip(state, ref_state, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(averaged, ref_averaged, strict=True))
    # the EMA is not the model: it averaged (num_batches_tracked and n_averaged aside)
    assert not torch.equal(averaged[0], state[0])
    # traces: the first call, the gradients made, i even or odd, the epoch; never n_averaged
    reasons = [t.reason for t in step.traces]
    assert not any("n_averaged" in r for r in reasons) and step.num_traces <= 5, reasons


@pytest.mark.inductor
def test_torchvision_recipe_with_its_ema_under_inductor() -> None:
    # One batch per epoch: two traces (the first call; the epoch past warm-up, with the
    # gradients and momentum made), each a cold Inductor compile of the ResNet. The
    # `i % model_ema_steps` branches are the eager test's.
    history, meters, _, averaged, step = recipe_run(jit=True, backend="inductor", per_epoch=1)
    ref_history, ref_meters, _, ref_averaged, _ = recipe_run(jit=False, per_epoch=1)
    assert step.num_traces == 2
    assert meters["loss"][2] == ref_meters["loss"][2] == 2  # counts: exact
    assert [n for n, _ in history] == [0, 1]  # warm-up copied; then it averaged
    assert [n for n, _ in history] == [n for n, _ in ref_history]
    # Inductor's fused kernels round differently (float32): close, not equal
    assert [v for _, v in history] == pytest.approx([v for _, v in ref_history], rel=1e-4)
    for a, b in zip(averaged, ref_averaged, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class RampedEMA(torch.optim.swa_utils.AveragedModel):
    """The recipe's EMA as projects copying it change it: the decay ramps up with the
    update count, ``math.exp`` of ``n_averaged`` (a tensor) in Python."""

    def __init__(self, model: nn.Module, decay: float, device: str = "cpu") -> None:
        self.decay_fn = lambda x: decay * (1 - math.exp(-x / 2000))

        def ema_avg(avg_model_param, model_param, num_averaged):
            decay = self.decay_fn(num_averaged)
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def ramped_run(jit: bool, backend: str = "eager") -> tuple:
    torch.manual_seed(0)
    # ReLU before BatchNorm: a bias right before it would get no gradient (Adam then
    # amplifies rounding noise, which Inductor's kernels round otherwise)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = RampedEMA(model, 0.999)

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        ema.update_parameters(model)
        return loss.detach()

    step = functacc.jit(body, modules=[model, ema], optimizers=[opt], backend=backend)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)) for _ in range(6)]
    losses = [(step if jit else body)(x, y) for x, y in batches]
    return losses, [t.detach().clone() for t in ema.state_dict().values()], step


def test_an_ema_whose_decay_is_math_exp_of_its_count_trains_as_in_eager() -> None:
    # math.exp(-n_averaged / 2000) reads the tensor's value: a TraceError before (math's
    # functions took symbols, not one-element tensors); now its value, a number the graph
    # computes, with no trace per count.
    losses, averaged, step = ramped_run(jit=True)
    ref_losses, ref_averaged, _ = ramped_run(jit=False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(averaged, ref_averaged, strict=True))
    assert int(averaged[0]) == 6 and step.num_traces == 1  # n_averaged, first in the dict


@pytest.mark.inductor
def test_an_ema_whose_decay_is_math_exp_of_its_count_under_inductor() -> None:
    losses, averaged, step = ramped_run(jit=True, backend="inductor")
    ref_losses, ref_averaged, _ = ramped_run(jit=False)
    # Inductor's fused float32 kernels round differently: close, not equal
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(averaged, ref_averaged, rtol=1e-4, atol=1e-6)
    assert int(averaged[0]) == 6 and step.num_traces == 1
