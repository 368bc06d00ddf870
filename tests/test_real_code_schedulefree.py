"""Schedule-Free optimizers (facebookresearch/schedule_free, the ``schedulefree`` package)
through ``functacc.jit``, against eager.

Their loop is the one their README gives: ``optimizer.train()`` before training (in the
step or outside it) and ``optimizer.eval()`` before evaluating, which move the weights
between the averaged and the training point with ``p.lerp_``. Their ``step()`` refuses to
run unless ``group["train_mode"]``, counts steps in ``group["k"]`` and keeps Python floats
in the param group (``lr_max``, ``weight_sum``, ``scheduled_lr``) that it rewrites each
step; ``warmup_steps`` is a Python branch on ``k``. Before 2026-11-29 ``functacc.jit``
failed at once: it made their state ahead by stepping a copy, which refused (not in train
mode yet); a state that cannot be made ahead is now made by the first call's graph. And
``ScheduleFreeWrapper`` over SGD, which keeps ``state["z"]`` in the SGD's ``state`` beside
SGD's step, trained a different model, silently (its entry went into the real dict under a
tensor of the trace): it is now a clear error.

With ``backend="eager"`` losses, the evaluated outputs, weights, gradients, optimizer state
and ``param_groups`` are compared bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import schedulefree
import torch
from test_jit import assert_same, tensors_of
from test_optimizers import body_of as train_step_of
from torch import nn

import functacc

OPTIMIZERS = {
    "AdamW": lambda p: schedulefree.AdamWScheduleFree(
        p, lr=1e-2, warmup_steps=3, weight_decay=0.01
    ),
    "AdamW-loop": lambda p: schedulefree.AdamWScheduleFree(
        p, lr=1e-2, warmup_steps=3, foreach=False
    ),
    "SGD": lambda p: schedulefree.SGDScheduleFree(p, lr=0.1, warmup_steps=2),
    "RAdam": lambda p: schedulefree.RAdamScheduleFree(p, lr=1e-2),
    # Under Inductor: no warm-up, so two compiles, not three.
    "AdamW-no-warmup": lambda p: schedulefree.AdamWScheduleFree(p, lr=1e-2, warmup_steps=0),
}


def build(name: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    return model, OPTIMIZERS[name](model.parameters())


def body_of(model: nn.Module, opt: Any, train_inside: bool) -> Any:
    step = train_step_of(model, opt)  # zero_grad, cross-entropy, backward, step

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.train()
        opt.train()
        return step(x, y)

    return train_step if train_inside else step


def batches(n: int) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def train(name: str, jit: bool, train_inside: bool, backend: str = "eager") -> tuple:
    model, opt = build(name)
    step = body_of(model, opt, train_inside)
    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend=backend)
    losses, evaluated = [], []
    for i, (x, y) in enumerate(batches(6)):
        if not train_inside:
            model.train()
            opt.train()
        torch.manual_seed(i)  # the same dropout masks
        losses.append(step(x, y))
        model.eval()
        opt.eval()  # the averaged weights, as the README evaluates
        with torch.no_grad():
            evaluated.append(model(x))
    return losses, evaluated, model, opt, step


@pytest.mark.parametrize("train_inside", [False, True], ids=["train-outside", "train-inside"])
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"AdamW-no-warmup"}))
def test_schedule_free_trains_and_evaluates_as_in_eager(name: str, train_inside: bool) -> None:
    losses, evaluated, model, opt, step = train(name, True, train_inside)
    ref_losses, ref_evaluated, ref, ref_opt, _ = train(name, False, train_inside)
    for got, expected in ((losses, ref_losses), (evaluated, ref_evaluated)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (got, expected)
    assert_same(tensors_of([model], [opt]), tensors_of([ref], [ref_opt]))
    groups, ref_groups = opt.state_dict()["param_groups"], ref_opt.state_dict()["param_groups"]
    assert groups == ref_groups  # k, lr_max, weight_sum, scheduled_lr, train_mode
    # The first call; the end of the warm-up (a Python branch on k); with train() in the
    # step, also its state made by the first call's graph (its step creates z and
    # exp_avg_sq, and refuses the dry step that makes them ahead until train() has run;
    # run before the first call, train() fills opt.state with empty dicts, which the step
    # reads again: made ahead then). Not one per step.
    assert step.num_traces == (3 if train_inside else 2), [t.reason for t in step.traces]


@pytest.mark.inductor
def test_schedule_free_adamw_under_inductor() -> None:
    # Its foreach update (torch._foreach_lerp_ and _foreach_sub_ with weights the graph
    # computes) is what Inductor's decompositions branched on before 2026-11-29.
    losses, evaluated, model, _, step = train("AdamW-no-warmup", True, False, "inductor")
    ref_losses, ref_evaluated, ref, _, _ = train("AdamW-no-warmup", False, False)
    # Fused kernels reassociate float32 sums (a few roundings per element over 6 steps);
    # a skipped warm-up or a stale average would move the losses by percents.
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(evaluated, ref_evaluated, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert step.num_traces == 1, [t.reason for t in step.traces]  # its state made ahead


def test_the_wrapper_over_sgd_is_a_clear_error_that_changes_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = schedulefree.ScheduleFreeWrapper(base, momentum=0.9, weight_decay_at_y=0.01)
    step = functacc.jit(
        body_of(model, opt, False), modules=[model], optimizers=[base], backend="eager"
    )
    opt.train()
    before = tensors_of([model], [base])
    with pytest.raises(ValueError, match=r"writes opt.state\[.*\]\['z'\] outside opt.step\(\)"):
        step(*batches(1)[0])
    assert_same(tensors_of([model], [base]), before)
    # Nothing left under a tensor of the trace (opt.train() made the empty entries).
    assert {id(k) for k in base.state} <= {id(p) for p in model.parameters()}
    assert all(not entries for entries in base.state.values())
