"""Hugging Face's ``transformers.optimization.Adafactor`` through ``functacc.jit``, against
eager, in the two settings its docstring recommends.

- T5 fine-tuning's (``scale_parameter=False, relative_step=False, lr=1e-3``): its state
  starts ``RMS = 0`` (a number) and the first step replaces it with a tensor
  (``state["RMS"] = self._rms(p)``). Before 2026-11-29 functacc made the state ahead with the
  number, and the trace failed with ``KeyError: ".state['model.0.weight']['RMS']"``; a state
  whose entries change kind in a step is now made by the first call's graph.
- ``relative_step=True, scale_parameter=True`` with ``AdafactorSchedule``: the step picks
  ``max(eps, state["RMS"])``, a tensor it just computed, on the host; a graph cannot. The
  error names ``Adafactor.step()`` and says what works: the step after the jitted call, which
  then trains as eager does (checked), or ``scale_parameter=False``.

With ``backend="eager"`` losses, weights and the optimizer state are compared bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_jit import assert_same, tensors_of
from test_optimizers import body_of, forward_backward_of
from torch import nn
from transformers.optimization import Adafactor, AdafactorSchedule

import functacc


def build(relative: bool) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    if relative:
        opt = Adafactor(model.parameters(), relative_step=True, warmup_init=True, lr=None)
        return model, opt, AdafactorSchedule(opt)
    opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    return model, opt, None


def batches(n: int = 6) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def test_t5_settings_train_as_in_eager() -> None:
    model, opt, _ = build(False)
    ref, ref_opt, _ = build(False)
    step = functacc.jit(body_of(model, opt), modules=[model], optimizers=[opt], backend="eager")
    eager = body_of(ref, ref_opt)
    for x, y in batches():
        assert torch.equal(step(x, y), eager(x, y))
    assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
    # The first call makes the state (RMS a number, then a tensor); the second traces the
    # steps that follow.
    assert step.num_traces == 2, [t.reason for t in step.traces]


def test_relative_steps_are_a_clear_error_whose_advice_trains_as_in_eager() -> None:
    model, opt, sched = build(True)
    step = functacc.jit(body_of(model, opt), modules=[model], optimizers=[opt], backend="eager")
    before = tensors_of([model], [opt])
    with pytest.raises(functacc.TraceError, match=r"Adafactor.step\(\) reads a tensor's value"):
        step(*batches(1)[0])
    assert_same(tensors_of([model], [opt]), before)

    # The advice: the step after the jitted call (the optimizer still in optimizers=).
    jitted = functacc.jit(
        forward_backward_of(model, opt), modules=[model], optimizers=[opt], backend="eager"
    )
    ref, ref_opt, ref_sched = build(True)
    eager = body_of(ref, ref_opt)
    for x, y in batches():
        loss = jitted(x, y)
        opt.step()
        sched.step()
        assert torch.equal(loss, eager(x, y))
        ref_sched.step()
        assert sched.get_last_lr() == ref_sched.get_last_lr()
    assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
