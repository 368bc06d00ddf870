"""``torch.amp.GradScaler`` in a ``functacc.jit`` body: the AMP recipe's loop (autocast,
``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()``) with the scale,
the inf check and the skipped step inside the graph, against the same loop run eagerly.

The reference is eager PyTorch: on the eager backend the jitted loop must leave the same
parameters, optimizer state, losses and scale bit for bit, including a step whose gradients
overflow (eager skips it and halves the scale; the graph selects the old values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from torch import nn

import functacc

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),  # functacc's twin
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.05),  # functacc's twin, a step count
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),  # its own step()
}


def build(optimizer: str = "AdamW", dtype: torch.dtype = torch.bfloat16, clip: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip:  # the recipe's gradient clipping: unscale first, then clip the true norm
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return model, opt, scaler, train_step


def batches(n: int = 7, overflow: tuple[int, ...] = (2,)) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        out.append((x * 1e38 if i in overflow else x, y))  # inf gradients: a skipped step
    return out


def run_both(backend: str = "eager", **options) -> tuple:
    model, opt, scaler, body = build(**options)
    ref_model, ref_opt, ref_scaler, ref_body = build(**options)
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend)
    rows = []
    for x, y in batches():
        got, expected = step(x, y), ref_body(x, y)
        rows.append((got, expected, scaler.get_scale(), ref_scaler.get_scale()))
    return rows, (model, opt, scaler, step), (ref_model, ref_opt, ref_scaler)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_amp_loop_equals_eager_bit_for_bit_with_a_skipped_step(optimizer, dtype) -> None:
    rows, (model, opt, scaler, step), (ref_model, ref_opt, ref_scaler) = run_both(
        optimizer=optimizer, dtype=dtype
    )
    scales = [r[3] for r in rows]
    # The overflowing batch (2) halved the scale; two finite steps doubled it (interval 2).
    assert scales[1] == 2.0 * scales[0] and scales[2] == scales[1] / 2, scales
    for got, expected, scale, ref_scale in rows:
        assert torch.equal(got, expected) or (got.isnan() & expected.isnan()).all()
        assert scale == ref_scale
    assert_close(model.state_dict(), ref_model.state_dict(), rtol=0, atol=0, what="model")
    assert str(opt.state_dict()) == str(ref_opt.state_dict())
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert step.num_traces == 1, [t.reason for t in step.traces]


def test_the_skipped_step_changes_no_parameter_and_no_state() -> None:
    model, opt, scaler, body = build("AdamW")
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    data = batches(overflow=(1,))
    step(*data[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    scale = scaler.get_scale()
    step(*data[1])
    assert_close(model.state_dict(), before, rtol=0, atol=0, what="model")
    assert_close(opt.state_dict()["state"], state, rtol=0, atol=0, what="optimizer")
    assert scaler.get_scale() == scale / 2


def test_unscale_and_clip_as_in_the_recipe() -> None:
    rows, (model, opt, _, step), (ref_model, ref_opt, _) = run_both(clip=True)
    for got, expected, scale, ref_scale in rows:
        assert torch.equal(got, expected) and scale == ref_scale
    assert_close(model.state_dict(), ref_model.state_dict(), rtol=0, atol=0, what="model")
    assert str(opt.state_dict()) == str(ref_opt.state_dict())
    assert step.num_traces == 1


def test_a_trainers_own_scaler_is_found() -> None:
    # A trainer holding model, optimizer and scaler as attributes, its step a method.
    class Trainer:
        def __init__(self) -> None:
            self.model, self.opt, self.scaler, _ = build("SGD")

        def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
            self.opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(self.model(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            return loss.item()

    trainer, reference = Trainer(), Trainer()
    step = functacc.jit(
        trainer.train_step, modules=[trainer.model], optimizers=[trainer.opt], backend="eager"
    )
    for x, y in batches():
        got, expected = step(x, y), reference.train_step(x, y)
        assert got == expected or (got != got and expected != expected)
    assert trainer.scaler.get_scale() == reference.scaler.get_scale()
    assert_close(
        trainer.model.state_dict(), reference.model.state_dict(), rtol=0, atol=0, what="model"
    )


@pytest.mark.inductor
def test_under_inductor_the_skip_and_the_scale_match_eager() -> None:
    # Inductor fuses and reorders the float32 update: rtol 1e-4 on the weights after 7
    # AdamW steps; the inf check and the scale are exact (which steps were skipped).
    rows, (model, _, _, step), (ref_model, _, _) = run_both("inductor")
    for got, expected, scale, ref_scale in rows:
        assert scale == ref_scale
        if expected.isfinite():
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert_close(model.state_dict(), ref_model.state_dict(), rtol=1e-4, atol=1e-6, what="model")
    assert step.num_traces == 1


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_skipped_first_step_leaves_zero_state_then_eagers_numbers(optimizer: str) -> None:
    # The one difference from eager, documented: the graph's optimizer state exists from
    # the first call (made ahead, zeros), while eager makes it at its first real step. A
    # first step that is skipped leaves it zero here and absent there; every later value
    # is the same (a zero momentum or moment then gives eager's first update exactly).
    model, opt, _, body = build(optimizer)
    ref_model, ref_opt, _, ref_body = build(optimizer)
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    for i, (x, y) in enumerate(batches(overflow=(0,))):
        step(x, y), ref_body(x, y)
        if i == 0:
            assert not ref_opt.state and len(opt.state) == len(list(model.parameters()))
    assert_close(model.state_dict(), ref_model.state_dict(), rtol=0, atol=0, what="model")
    assert str(opt.state_dict()) == str(ref_opt.state_dict())
