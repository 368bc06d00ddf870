"""What a jitted body reads of its optimizers and parameters besides ``opt.step()``: eager's.

- a learning rate read from ``param_groups`` and used as ``alpha`` (``p.sub_(g, alpha=lr)``,
  as ``ScheduleFreeWrapper`` and hand-written updates do): before 2026-11-29 ``sub_`` was a
  ``TraceError`` ("branch on tensor values": torch's reference ``sub`` asks
  ``alpha != 1``), and ``torch.sub``, ``torch.rsub`` and ``torch.addmm(beta=, alpha=)``
  traced again for every new learning rate (the rate was fixed into each graph);
- ``opt.state[p]`` read in the body (Adam's ``exp_avg``, SGD's momentum buffer): it was a
  ``KeyError`` naming a fake tensor; a write there beside functacc's own update of SGD,
  Adam or AdamW went into the real dict under a tensor of the trace, silently (and
  ``opt.state_dict()`` failed after); it is now a clear error that changes nothing;
- a dict keyed by parameters (``slow = {p: p.clone() for p in model.parameters()}``, a
  Lookahead's slow weights): looked up with ``slow[p]`` it was a ``KeyError`` naming a
  fake tensor; iterated, its keys were the real parameters, not the step's.

With ``backend="eager"`` everything is compared bit for bit with the same eager loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_jit import assert_same, tensors_of
from torch import nn

import functacc

UPDATES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], Any]] = {
    "sub_": lambda p, g, lr: p.sub_(g, alpha=lr),
    "sub": lambda p, g, lr: p.copy_(torch.sub(p, g, alpha=lr)),
    "rsub": lambda p, g, lr: p.copy_(torch.rsub(g, p, alpha=lr)),
    "foreach_sub_": lambda p, g, lr: torch._foreach_sub_([p], [g], alpha=lr),
    "addmm": lambda p, g, lr: (
        p.copy_(torch.addmm(p, g, g.t(), beta=1 - lr, alpha=-lr))
        if p.dim() == 2
        else p.sub_(g * lr)
    ),
}


def train(update: str, jit: bool) -> tuple[list, nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().sum()
        loss.backward()
        with torch.no_grad():
            lr = opt.param_groups[0]["lr"]
            for p in model.parameters():
                UPDATES[update](p, p.grad, lr)
        opt.zero_grad()
        return loss.detach()

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        losses.append(step(torch.randn(4, 3, generator=g)))
        opt.param_groups[0]["lr"] *= 0.9  # a new rate every call
    return losses, model, opt, step


@pytest.mark.parametrize("update", sorted(UPDATES))
def test_a_learning_rate_read_as_alpha_is_fed_not_fixed(update: str) -> None:
    losses, model, opt, step = train(update, True)
    ref_losses, ref, ref_opt, _ = train(update, False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
    assert step.num_traces == 1, [t.reason for t in step.traces]


def run_reading_state(kind: str, jit: bool) -> tuple[list, list, nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    if kind == "Adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    log: list = []

    def step(x: torch.Tensor) -> torch.Tensor:
        weight = model[0].weight
        before = (weight in opt.state, len(opt.state[weight]))  # empty before the first step
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        entries = opt.state[weight]
        if kind == "Adam":
            log.append((*before, entries["step"].item(), entries["exp_avg"].norm().item()))
        else:
            log.append((*before, entries["momentum_buffer"].abs().sum().item()))
        opt.zero_grad()
        return loss.detach()

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    g = torch.Generator().manual_seed(2)
    losses = [step(torch.randn(5, 3, generator=g)) for _ in range(4)]
    if jit:  # the second call traces again (the state exists before the step now), to
        # the same graph: one program, its Python replayed with the new answers
        assert step.num_traces == 1, [t.reason for t in step.traces]
    return losses, log, model, opt


@pytest.mark.parametrize("kind", ["Adam", "SGD"])
def test_opt_state_read_in_the_step_gives_eagers_values(kind: str) -> None:
    losses, log, model, opt = run_reading_state(kind, True)
    ref_losses, ref_log, ref, ref_opt = run_reading_state(kind, False)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert log == ref_log, (log, ref_log)
    assert log[0][:2] == (False, 0) and log[1][:2] == (True, len(ref_opt.state[ref[0].weight]))
    assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))


def test_opt_state_written_outside_the_step_is_a_clear_error_that_changes_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        entries = opt.state[model.weight]
        if "slow" not in entries:
            entries["slow"] = model.weight.detach().clone()
        opt.zero_grad()
        return loss.detach()

    opt.step()  # no gradients yet: the state is made, nothing moves
    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    before = tensors_of([model], [opt])
    with pytest.raises(ValueError, match=r"writes opt.state\[.*weight\]\['slow'\] outside"):
        jitted(torch.randn(4, 3))
    assert_same(tensors_of([model], [opt]), before)
    assert all(isinstance(k, nn.Parameter) for k in opt.state)  # no tensor of the trace


def run_keyed_by_parameters(kind: str, jit: bool) -> tuple[list, list, list]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slow = {p: p.detach().clone() for p in model.parameters()}
    counts = dict.fromkeys(model.parameters(), 0)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            if kind == "lookup":  # slow[p] for each parameter, and a counter per parameter
                for p in model.parameters():
                    slow[p].lerp_(p, 0.5)
                    counts[p] += 1
            elif kind == "items":  # the keys the body iterates are the step's parameters
                for p, s in slow.items():
                    s.lerp_(p, 0.5)
                    p.copy_(s)
            else:  # entries assigned anew
                for p in slow:
                    slow[p] = slow[p] * 0.5 + p
        return loss.detach()

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    g = torch.Generator().manual_seed(1)
    losses = [step(torch.randn(4, 3, generator=g)) for _ in range(4)]
    assert not jit or step.num_traces == 1, [t.reason for t in step.traces]
    return losses + list(model.parameters()), list(slow.values()), list(counts.values())


@pytest.mark.parametrize("kind", ["lookup", "items", "assigned"])
def test_a_dict_keyed_by_parameters_is_read_and_written_as_in_eager(kind: str) -> None:
    got, slow, counts = run_keyed_by_parameters(kind, True)
    expected, ref_slow, ref_counts = run_keyed_by_parameters(kind, False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(slow, ref_slow, strict=True))
    assert counts == ref_counts


@pytest.mark.inductor
def test_the_reads_under_inductor() -> None:
    # One body with the three: a rate read as alpha, opt.state read, a dict keyed by
    # parameters; Inductor's fused kernels within rtol 1e-4 (float32 reassociation), where a
    # stale rate, a missing state entry or a stale slow weight would move them by percents.
    def run(jit: bool) -> tuple[list, list, list]:
        torch.manual_seed(0)
        model = nn.Linear(3, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        slow = {p: p.detach().clone() for p in model.parameters()}
        log: list = []

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                lr = opt.param_groups[0]["lr"]
                for p in model.parameters():
                    slow[p].sub_(slow[p] - p, alpha=lr)
                log.append(opt.state[model.weight]["exp_avg"].norm().item())
            return loss.detach()

        if jit:
            step = functacc.jit(step, modules=[model], optimizers=[opt], backend="inductor")
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            losses.append(step(torch.randn(4, 3, generator=g)))
            opt.param_groups[0]["lr"] *= 0.9
        return losses, list(slow.values()), log

    got, slow, log = run(True)
    expected, ref_slow, ref_log = run(False)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-4, atol=1e-6)
    for a, b in zip(slow, ref_slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(log, ref_log, rtol=1e-4, atol=1e-6)
