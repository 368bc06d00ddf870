"""Tent (DequanWang/tent, test-time adaptation by entropy minimization) under ``functacc.jit``.

Its ``Tent`` module holds the model and the optimizer (``self.optimizer``) and adapts on
every forward: ``forward_and_adapt`` (under ``@torch.enable_grad()``, called from a
``torch.no_grad()`` evaluation loop) takes the entropy of the predictions
(``softmax_entropy``, a ``@torch.jit.script`` function), steps an Adam or SGD over the batch
norms' affine parameters only, and the batch norms normalize with the batch's statistics
(``track_running_stats = False``, ``running_mean = None``). Found on 2026-11-30:

- the jitted ``Tent`` traced again on every call (0.5 s of host time each): the watch of
  its modules' settings looked into ``self.optimizer`` and keyed its state by the
  parameters' values. An optimizer or a scheduler a module keeps is keyed by identity now;
- the episodic mode (``reset()`` before each batch: ``model.load_state_dict`` and
  ``optimizer.load_state_dict`` inside the step) was a ``TraceError`` advising to pass a
  tensor as an argument, which does not apply; it now names the load and its line, and
  advises the reset before the call, checked here to adapt as eager does.

On the eager backend everything is compared bit for bit.
"""

from __future__ import annotations

import logging

import pytest
import tent
import torch
from torch import nn

import functacc


def batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 3, 8, 8, generator=g) for _ in range(n)]


def build(
    optimizer: str, episodic: bool = False
) -> tuple[tent.Tent, nn.Module, torch.optim.Optimizer]:
    """A small convolutional net set up as tent's ``cifar10c.py`` sets up its model."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    net = tent.configure_model(net)
    tent.check_model(net)
    params, _ = tent.collect_params(net)
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.999))
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return tent.Tent(net, opt, steps=2, episodic=episodic), net, opt


def evaluate(model: nn.Module, xs: list[torch.Tensor], before: object = None) -> list:
    outputs = []
    for x in xs:
        if before is not None:
            before()
        with torch.no_grad():  # its evaluation loop; forward_and_adapt enables grad
            outputs.append(model(x))
    return outputs


def assert_same(a: list, b: list, net: nn.Module, ref: nn.Module, opt: object, ref_opt: object):
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert str(opt.state_dict()) == str(ref_opt.state_dict())  # type: ignore[attr-defined]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_tent_jitted_whole_adapts_as_eager_with_one_trace(
    optimizer: str, caplog: pytest.LogCaptureFixture
):
    model, net, opt = build(optimizer)
    ref_model, ref_net, ref_opt = build(optimizer)
    jitted = functacc.jit(model, modules=[model], optimizers=[opt], backend="eager")
    with caplog.at_level(logging.INFO, logger="functacc"):
        out, ref_out = evaluate(jitted, batches()), evaluate(ref_model, batches())
    assert_same(out, ref_out, net, ref_net, opt, ref_opt)
    assert jitted.num_traces == 1, [t.reason for t in jitted.traces]
    # Nor traced again for a graph it had (host time on every call before 2026-11-30).
    traced = [r.message for r in caplog.records if "traced the jitted step" in r.message]
    assert len(traced) == 1 and "first call" in traced[0], traced


def test_episodic_tent_gets_advice_that_adapts_as_eager():
    model, net, opt = build("adam", episodic=True)
    jitted = functacc.jit(model, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"load_state_dict\(.*tent.py:\d+.*outside"):
        evaluate(jitted, batches(1))
    # The advice: the reset before the call, the adaptation jitted.
    model, net, opt = build("adam", episodic=True)
    adapt = functacc.jit(tent.forward_and_adapt, modules=[net], optimizers=[opt], backend="eager")

    def episodic(x: torch.Tensor) -> torch.Tensor:
        for _ in range(model.steps):
            outputs = adapt(x, net, opt)
        return outputs

    ref_model, ref_net, ref_opt = build("adam", episodic=True)
    out = evaluate(episodic, batches(), before=model.reset)
    assert_same(out, evaluate(ref_model, batches()), net, ref_net, opt, ref_opt)
    assert adapt.num_traces <= 2, [t.reason for t in adapt.traces]
