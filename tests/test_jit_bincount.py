"""``torch.bincount(x, minlength=n)`` in a jitted step: eager's counts, with no host sync.

Training steps count labels per batch: class weights from the batch
(``1 / torch.bincount(y, minlength=C)``), a confusion matrix as torchvision's segmentation
reference makes it (``torch.bincount(n * target + pred, minlength=n ** 2).reshape(n, n)``),
per-class sums of a loss (``weights=``). torch sizes the result on the host from the values
(``max(n, x.max() + 1)``), which a graph traced once cannot: before 2026-11-30 the trace
failed where the counts were used, with advice (``torch.where``) that did not fit. While
traced, the counts are ``n`` long, made in the graph in eager's dtype and order, and the
graph asserts that every value is in ``[0, n)`` (where eager's size is ``n`` too): a call
that meets another value fails before it writes any state.

On the eager backend every comparison is bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc

CLASSES = 4


def batches(n: int = 5, top: int = CLASSES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(16, 6, generator=g), torch.randint(0, top, (16,), generator=g))
        for _ in range(n)
    ]


def balanced(model: nn.Module, opt: torch.optim.Optimizer) -> Callable:
    """Class weights from the batch's labels; per-class loss sums and a confusion matrix
    returned (the method form, and ``weights=`` of float32 and of float16)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        counts = torch.bincount(y, minlength=CLASSES)
        logits = model(x)
        losses = F.cross_entropy(logits, y, weight=1.0 / (counts.float() + 1), reduction="none")
        loss = losses.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        pred = logits.argmax(1)
        confusion = (CLASSES * y + pred).bincount(minlength=CLASSES**2).reshape(CLASSES, -1)
        per_class = torch.bincount(y, weights=losses.detach(), minlength=CLASSES)
        half = torch.bincount(y, weights=losses.detach().half(), minlength=CLASSES)
        return loss.detach(), counts, confusion, per_class, half

    return step


def train(jit: bool, backend: str = "eager", data: list | None = None) -> tuple[list, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = balanced(model, opt)
    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend=backend)
    out = [step(x, y) for x, y in (data or batches())]
    if jit:
        assert step.num_traces == 1, [t.reason for t in step.traces]
    return out, model


def test_counts_class_weights_and_a_confusion_matrix_as_eager():
    (got, model), (expected, ref) = train(True), train(False)
    for call, (a, b) in enumerate(zip(got, expected, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), (call, x, y)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_value_beyond_minlength_fails_the_call_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(6, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y.clamp(max=CLASSES - 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return torch.bincount(y, minlength=CLASSES)

    jitted = functacc.jit(step, modules=[model], optimizers=[opt], backend="eager")
    x, y = batches(1)[0]
    jitted(x, y)
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    y = y.clone()
    y[3] = CLASSES  # eager: CLASSES + 1 counts
    with pytest.raises(RuntimeError, match=r"torch.bincount\(x, minlength=n\)"):
        jitted(x, y)
    after = (model.state_dict(), opt.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values(), strict=True)
    )
    state, state_after = before[1]["state"], after[1]["state"]
    assert all(
        torch.equal(state[i]["momentum_buffer"], state_after[i]["momentum_buffer"]) for i in state
    )


@pytest.mark.inductor
def test_counts_under_inductor():
    (got, _), (expected, _) = train(True, "inductor"), train(False)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # counts: exact
        # The losses and their sums: float32 kernels fused differently, a few roundings.
        torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-5)
