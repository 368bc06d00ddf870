"""An optimizer that wraps another, through ``functacc.jit`` and ``compile_step``, against
eager: timm's ``Lookahead`` (``create_optimizer_v2(model, "lookahead_adamw")``).

``Lookahead`` shares its base optimizer's ``param_groups`` list, runs the base's ``step()``
and, every ``k`` steps, pulls the weights toward slow copies it keeps in the *base's*
``state`` (``lookahead_slow_buff``); its own ``state`` stays empty. Before 2026-11-29
functacc traced its ``step()`` over the wrapper's (empty) state: the base's state was made
afresh inside every trace, under keys that were tensors of the trace, so from the third
call on the weights were not eager's, silently, and ``opt.state_dict()`` then failed with a
``KeyError``. The state of a wrapper's optimizer is now its base's: made ahead as the base
makes it (torch's ``_init_group``), an input of the graph, written in place.

With ``backend="eager"`` losses, weights, ``.grad`` and ``state_dict()`` (the base's, slow
buffers included) are compared bit for bit over 8 steps with ``k=3``: two slow updates.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import timm.optim
import torch
import torch.nn.functional as F
from test_jit import assert_same, tensors_of
from test_optimizers import body_of
from torch import nn

import functacc

BASES = ["adamw", "radam", "rmsprop", "sgd", "lamb"]


def build(base: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    inner = timm.optim.create_optimizer_v2(model, base, lr=1e-2, weight_decay=0.01)
    return model, timm.optim.Lookahead(inner, alpha=0.5, k=3)


def train(base: str, front: str, backend: str = "eager") -> tuple[list, nn.Module, Any, Any]:
    model, opt = build(base)
    body = body_of(model, opt)
    if front == "jit":
        step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend)
    elif front == "compile_step":
        step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend=backend)
    else:
        step = body
    g = torch.Generator().manual_seed(3)
    losses = []
    for i in range(8):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        torch.manual_seed(i)  # the same dropout masks
        losses.append(step(x, y))
    return losses, model, opt, step


@pytest.mark.parametrize("front", ["jit", "compile_step"])
@pytest.mark.parametrize("base", BASES)
def test_lookahead_trains_as_in_eager(base: str, front: str) -> None:
    losses, model, opt, step = train(base, front)
    ref_losses, ref, ref_opt, _ = train(base, "eager")
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    mine, theirs = tensors_of([model], [opt]), tensors_of([ref], [ref_opt])
    if front == "compile_step":  # its gradients live inside the graph
        mine = {k: v for k, v in mine.items() if not k.endswith(".grad")}
        theirs = {k: v for k, v in theirs.items() if not k.endswith(".grad")}
    assert_same(mine, theirs)
    assert str(opt.state_dict()) == str(ref_opt.state_dict())
    assert any("lookahead_slow_buff" in s for s in opt.state_dict()["state"].values())
    # The first call; the state a first step made (SGD's momentum buffer, timm's Lamb) or
    # the slow buffers the first slow update made; each outcome of its branch
    # (lookahead_step % k == 0): a few traces, never one per step (8 steps here).
    assert step.num_traces <= 4, [t.reason for t in step.traces]


@pytest.mark.inductor
def test_lookahead_adamw_under_inductor() -> None:
    losses, model, _, _ = train("adamw", "jit", backend="inductor")
    ref_losses, ref, _, _ = train("adamw", "eager")
    # Fused kernels reassociate float32 sums (a few roundings per element over 8 steps); a
    # missed slow update or a fresh AdamW state would move the losses by percents.
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


class SharpnessAware(torch.optim.Optimizer):
    """davda54/sam's ``SAM`` (sam.py, commit 87a9604), as that repository's train.py uses it:
    the base optimizer is built over this one's param groups and shares them; the weights
    before the ascent are kept in this optimizer's ``state[p]["old_p"]`` and put back with
    ``p.data = ...``."""

    def __init__(self, params: Any, base: type, rho: float = 0.05, adaptive: bool = False, **kw):
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kw))
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_((torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def _grad_norm(self) -> torch.Tensor:
        return torch.norm(
            torch.stack(
                [
                    ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2)
                    for group in self.param_groups
                    for p in group["params"]
                    if p.grad is not None
                ]
            ),
            p=2,
        )


def _running_stats(model: nn.Module, on: bool) -> None:
    # davda54/sam's utility/bypass_bn.py: the second pass leaves BatchNorm's statistics be
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            if on and hasattr(m, "backup_momentum"):
                m.momentum = m.backup_momentum
            elif not on:
                m.backup_momentum = m.momentum
                m.momentum = 0


def train_sam(base: type, jit: bool) -> tuple[list, nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    options = dict(lr=0.1, momentum=0.9, weight_decay=5e-4) if base is torch.optim.SGD else {}
    opt = SharpnessAware(model.parameters(), base, rho=2.0, adaptive=True, **options)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # train.py's loop body: the first pass updates BatchNorm's statistics, the second not
        _running_stats(model, True)
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        opt.first_step(zero_grad=True)
        _running_stats(model, False)
        F.cross_entropy(model(x), y, label_smoothing=0.1).backward()
        opt.second_step(zero_grad=True)
        return loss.detach()

    step = functacc.jit(train_step, modules=[model], optimizers=[opt], backend="eager")
    step = step if jit else train_step
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))]
    losses = [step(*batches[0])]
    for _ in range(5):
        losses.append(step(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)))
    return losses, model, opt


@pytest.mark.parametrize("base", [torch.optim.SGD, torch.optim.Adam], ids=["SGD", "Adam"])
def test_sharpness_aware_minimization_trains_as_in_eager(base: type) -> None:
    # Before 2026-11-29 the base optimizer's state was made afresh in each trace: from the
    # third step the weights were not eager's, silently.
    losses, model, opt = train_sam(base, True)
    ref_losses, ref, ref_opt = train_sam(base, False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert_same(tensors_of([model], []), tensors_of([ref], []))  # weights, BatchNorm's stats
    # The base's state is eager's (momentum, Adam's moments). The weights kept for the
    # ascent (old_p) show in it too, where eager keeps them in SAM's own state; and eager's
    # old_p is the parameter's storage after `p.data = old_p` (the base's update moved it
    # too), where functacc's holds the weights the last ascent started from.
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        mine, theirs = opt.base_optimizer.state[p], ref_opt.base_optimizer.state[q]
        assert set(mine) == set(theirs) | {"old_p"}
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        assert ref_opt.state[q]["old_p"].data_ptr() == q.data_ptr()


def test_a_wrappers_checkpoint_in_the_step_is_a_clear_error() -> None:
    # SAM's state_dict() leaves out its base's, so a checkpoint saves both; in the step
    # both are refused as any optimizer's (its state is the graph's while traced). Before,
    # the base's was a KeyError from inside torch.optim.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = SharpnessAware(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        F.cross_entropy(model(x), y).backward()
        opt.first_step(zero_grad=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.second_step(zero_grad=True)
        torch.save({"base": opt.base_optimizer.state_dict()}, io.BytesIO())
        return loss.detach()

    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    before = tensors_of([model], [opt])
    with pytest.raises(functacc.TraceError, match="state_dict"):
        jitted(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    assert_same(tensors_of([model], [opt]), before)
