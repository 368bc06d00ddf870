"""The pure form (``init_state``/``apply``) of a compile_step on jit's pipeline.

An optimizer without a pure twin (RMSprop, NAdam) runs compile_step's body on ``jit``;
``apply`` copies the state in, steps, copies it out and restores the model and the
optimizer. The reference is the eager loop, bit for bit (the eager backend runs the same
ATen ops in the same order).
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
from helpers import Snapshot, assert_close
from torch import nn

import functacc

OPTIMIZERS = [torch.optim.RMSprop, torch.optim.NAdam]


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
        for _ in range(n)
    ]


def build(opt_cls, **options):
    torch.manual_seed(0)
    model = models.cnn_bn()
    opt = opt_cls(model.parameters(), lr=1e-3)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend="eager", **options)
    return model, opt, step


@pytest.mark.parametrize("opt_cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_apply_is_pure_and_equals_the_eager_loop(opt_cls) -> None:
    model, opt, step = build(opt_cls)
    ref = copy.deepcopy(model)
    ref_opt = opt_cls(ref.parameters(), lr=1e-3)
    before = Snapshot(model, opt, step)
    state = step.init_state()
    for i, (x, y) in enumerate(batches()):
        given = copy.deepcopy(state)
        torch.manual_seed(i)
        new, loss = step.apply(state, x, y)
        assert_close(state, given, rtol=0, atol=0, what="the state given")  # not mutated
        torch.manual_seed(i)
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss.detach())
        state = new
    torch.set_rng_state(before.rng)  # apply draws dropout masks as the stateful step does
    before.assert_unchanged()  # the model, the optimizer and the step count
    assert_close(state.params, dict(ref.named_parameters()), rtol=0, atol=0, what="params")
    assert_close(state.buffers, dict(ref.named_buffers()), rtol=0, atol=0, what="buffers")
    names = {p: n for n, p in ref.named_parameters()}
    ref_state = {names[p]: s for p, s in ref_opt.state.items()}
    assert_close(state.opt_state, ref_state, rtol=0, atol=0, what="optimizer state")
    assert int(state.count) == 3 and step.num_traces == 1


@pytest.mark.parametrize("opt_cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_the_stateful_step_after_apply_goes_on_from_its_own_state(opt_cls) -> None:
    # apply() swaps the optimizer's state dict for one of the given state and back: the
    # next stateful call must train from the model's and the optimizer's own state.
    model, opt, step = build(opt_cls)
    ref = copy.deepcopy(model)
    ref_opt = opt_cls(ref.parameters(), lr=1e-3)
    (x, y), (x2, y2), (x3, y3) = batches()
    for inputs, targets in ((x, y), (x2, y2)):
        torch.manual_seed(0)
        step(inputs, targets)
        torch.manual_seed(0)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(inputs), targets).backward()
        ref_opt.step()
        state = step.init_state()
        state.params.update({n: p * 2 for n, p in state.params.items()})  # not the model's
        step.apply(state, x3, y3)
    assert_close(
        dict(model.named_parameters()), dict(ref.named_parameters()), rtol=0, atol=0, what="model"
    )
    assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=0, atol=0, what="optimizer")
    assert step.count == 2


def test_a_failed_apply_changes_nothing_and_bad_states_are_clear_errors() -> None:
    model, opt, step = build(torch.optim.RMSprop)
    x, y = batches(1)[0]
    step(x, y)
    state = step.init_state()
    snap = Snapshot(model, opt, step)
    with pytest.raises(functacc.errors.TraceError, match="target batch_size"):
        step.apply(state, x, y[:3])  # the targets of another batch size
    snap.assert_unchanged()
    with pytest.raises(TypeError, match="expects the TrainState from init_state"):
        step.apply(dict(state.params), x, y)
    with pytest.raises(ValueError, match=r"missing \['0.weight'\]"):
        step.apply(
            state._replace(params={n: p for n, p in state.params.items() if n != "0.weight"}), x, y
        )
    snap.assert_unchanged()
    new, _ = step.apply(state, x, y)  # and it still works
    assert int(new.count) == 2


def test_apply_with_fp16_loss_scaling_carries_the_scale_in_the_state() -> None:
    precision = functacc.Precision("fp16", growth_interval=1)  # grows every good step
    _, _, step = build(torch.optim.RMSprop, precision=precision)
    x, y = batches(1)[0]
    state = step.init_state()
    scale = float(state.extra["loss_scale"]["scale"])
    new, _ = step.apply(state, x, y)
    assert float(new.extra["loss_scale"]["scale"]) == 2 * scale
    assert step.loss_scale == scale and step.count == 0  # the step's own scaler unchanged
    newer, _ = step.apply(new, x, y)
    assert float(newer.extra["loss_scale"]["scale"]) == 4 * scale


@pytest.mark.inductor
def test_apply_under_inductor_runs_the_stateful_steps_graph() -> None:
    # One Inductor compile serves both forms: apply() from the model's own state gives the
    # bits the stateful call then gives from the same state (the model was restored).
    torch.manual_seed(0)
    model = models.cnn_bn()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt)
    x, y = batches(1)[0]
    torch.manual_seed(1)
    new, loss = step.apply(step.init_state(), x, y)
    torch.manual_seed(1)
    assert torch.equal(step(x, y), loss)
    assert_close(new.params, dict(model.named_parameters()), rtol=0, atol=0, what="params")
    assert_close(new.buffers, dict(model.named_buffers()), rtol=0, atol=0, what="buffers")
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: s for p, s in opt.state.items()}
    assert_close(new.opt_state, state, rtol=0, atol=0, what="optimizer state")
    assert step.num_traces == 1
