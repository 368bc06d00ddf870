"""timm's ``train.py`` ``train_one_epoch`` (huggingface/pytorch-image-models, commit
aa4b585) through ``functacc.jit``, against eager.

The step is one iteration of the epoch's loop, as written there: its ``_forward`` and
``_backward`` closures over a ``ClassificationTask`` (label smoothing, an EMA made by
``task.setup_ema``), gradient accumulation by the batch index (``need_update``), clipping
with ``utils.dispatch_clip_grad``, the meters (``utils.AverageMeter``: ``loss.item()``,
``time.time()``), the log line with the learning rate averaged over the param groups, and
the scheduler made by ``create_scheduler_v2`` (cosine, warm-up, ``step_on_epochs=False``)
stepped with ``lr_scheduler.step_update(num_updates=..., metric=losses_m.avg)``. The loop's
variables are the module's globals (the nested function's ``nonlocal``s in timm). With
``backend="eager"`` the log lines, the meters, the learning rate, the weights and the EMA's
are compared bit for bit.

Before 2026-11-29 timm's scheduler stepped in the step was a ``TraceError`` ("left a value
of its trace in ... lr_scheduler.metric"): functacc noted torch's schedulers' steps but ran
timm's while tracing. And the no-update and update iterations, which read different
numbers, traced again on alternate calls once both had been seen (each trace's new numbers
changed the other's signature); a program whose own conditions still hold is now reused.
"""

from __future__ import annotations

import logging
import re
import time
import types
from contextlib import suppress

import pytest
import torch

import functacc

timm = pytest.importorskip("timm")
from timm import utils  # noqa: E402
from timm.optim import create_optimizer_v2  # noqa: E402
from timm.scheduler import create_scheduler_v2  # noqa: E402
from timm.task import ClassificationTask  # noqa: E402

_logger = logging.getLogger("train")
BATCHES = 8


def setup() -> None:
    """train.py's objects and train_one_epoch's variables before its loop, as globals."""
    global task, optimizer, lr_scheduler, loss_scaler, amp_autocast, args, second_order
    global update_time_m, data_time_m, losses_m, epoch, accum_steps, last_accum_steps
    global updates_per_epoch, num_updates, last_batch_idx, last_batch_idx_to_accum
    global data_start_time, update_start_time, update_sample_count
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=5, pretrained=False)
    task = ClassificationTask(model, criterion_kwargs=dict(smoothing=0.1), verbose=False)
    task.setup_ema(decay=0.99, use_warmup=True)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    lr_scheduler, _ = create_scheduler_v2(
        optimizer,
        sched="cosine",
        num_epochs=2,
        warmup_epochs=1,
        warmup_lr=1e-5,
        step_on_epochs=False,
        updates_per_epoch=BATCHES // 2,
    )
    loss_scaler, amp_autocast, second_order = None, suppress, False
    args = types.SimpleNamespace(
        grad_accum_steps=2, clip_grad=1.0, clip_mode="norm", distributed=False, log_interval=1
    )
    update_time_m, data_time_m, losses_m = (utils.AverageMeter() for _ in range(3))
    epoch = 0
    accum_steps = args.grad_accum_steps
    last_accum_steps = BATCHES % accum_steps
    updates_per_epoch = (BATCHES + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = BATCHES - 1
    last_batch_idx_to_accum = BATCHES - last_accum_steps
    data_start_time = update_start_time = time.time()
    optimizer.zero_grad()
    update_sample_count = 0


def iteration(batch_idx: int, input: torch.Tensor, target: torch.Tensor) -> None:
    # train_one_epoch's loop body (its non-distributed, non-naflex path)
    global accum_steps, num_updates, update_sample_count, data_start_time, update_start_time
    last_batch = batch_idx == last_batch_idx
    need_update = last_batch or (batch_idx + 1) % accum_steps == 0
    update_idx = batch_idx // accum_steps
    if batch_idx >= last_batch_idx_to_accum:
        accum_steps = last_accum_steps
    data_time_m.update(accum_steps * (time.time() - data_start_time))

    def _forward():
        with amp_autocast():
            result = task(input, target)
            _loss = result["loss"]
        if accum_steps > 1:
            _loss /= accum_steps
        return _loss, result

    def _backward(_loss):
        clip_parameters = None
        if args.clip_grad is not None:
            clip_parameters = task.get_clip_parameters(exclude_head="agc" in args.clip_mode)
        if loss_scaler is not None:
            loss_scaler(_loss, optimizer, clip_grad=args.clip_grad, need_update=need_update)
        else:
            _loss.backward(create_graph=second_order)
            if need_update:
                if args.clip_grad is not None:
                    utils.dispatch_clip_grad(
                        clip_parameters, value=args.clip_grad, mode=args.clip_mode
                    )
                optimizer.step()

    batch_size = input.shape[0]
    global_batch_size = batch_size
    loss, result = _forward()  # noqa: RUF059 (as written)
    _backward(loss)
    losses_m.update(loss.item() * accum_steps, batch_size)
    update_sample_count += global_batch_size
    if not need_update:
        data_start_time = time.time()
        return
    num_updates += 1
    optimizer.zero_grad()
    task.update_ema(step=num_updates)
    time_now = time.time()
    update_time_m.update(time.time() - update_start_time)
    update_start_time = time_now
    if update_idx % args.log_interval == 0 or last_batch:
        lrl = [param_group["lr"] for param_group in optimizer.param_groups]
        lr = sum(lrl) / len(lrl)
        loss_avg, loss_now = losses_m.avg, losses_m.val
        _logger.info(
            f"Train: {epoch} [{update_idx:>4d}/{updates_per_epoch} "
            f"({100.0 * (update_idx + 1) / updates_per_epoch:>3.0f}%)]  "
            f"Loss: {loss_now:#.3g} ({loss_avg:#.3g})  "
            f"Time: {update_time_m.val:.3f}s  "
            f"LR: {lr:.3e}"
        )
    if lr_scheduler is not None:
        lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
    update_sample_count = 0
    data_start_time = time.time()


def epoch_run(jit: bool, caplog: pytest.LogCaptureFixture) -> tuple[list[str], dict, object]:
    setup()
    step = iteration
    if jit:
        step = functacc.jit(iteration, modules=[task], optimizers=[optimizer], backend="eager")
    g = torch.Generator().manual_seed(1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        for batch_idx in range(BATCHES):
            x, y = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 5, (2,), generator=g)
            step(batch_idx, x, y)
    lines = [re.sub(r"Time: \S+", "", r.getMessage()) for r in caplog.records if r.name == "train"]
    state = {
        "model": {k: v.clone() for k, v in task.get_trainable_module().state_dict().items()},
        "ema": {k: v.clone() for k, v in task.get_trainable_module(ema=True).state_dict().items()},
        "numbers": (num_updates, losses_m.avg, losses_m.count, update_time_m.count),
        "lr": [group["lr"] for group in optimizer.param_groups],
        "metric": lr_scheduler.metric,
    }
    return lines, state, step


def test_timms_train_one_epoch_with_its_scheduler_stepped_per_update_runs_as_in_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eager_lines, eager, _ = epoch_run(False, caplog)
    lines, state, step = epoch_run(True, caplog)
    assert lines == eager_lines and len(lines) == BATCHES // 2
    assert "LR: 1.000e-05" in lines[0] and "LR: 1.000e-05" not in lines[1]  # warm-up moves
    assert state["numbers"] == eager["numbers"] and state["lr"] == eager["lr"]
    assert state["metric"] == eager["metric"] == losses_m.avg
    for part in ("model", "ema"):
        for k, v in state[part].items():
            assert torch.equal(v, eager[part][k]), (part, k)
    # No update, update (its gradients then kept: a new signature), each again once their
    # numbers are fed (a time, a meter's sum turned float), and the last batch's branch;
    # then the programs of the iterations before are reused, not traced again.
    assert step.num_traces == 5 and step._engine.engine.reused == 0, [t.reason for t in step.traces]
