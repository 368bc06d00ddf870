"""An optimizer's ``state`` changed in place between calls: the next call reads it, as eager.

Code between steps restarts an optimizer by changing its ``state`` dict in place:
``opt.state.clear()`` (episodic test-time adaptation resets the adapted layers with
``load_state_dict`` and the optimizer with ``state.clear()`` before each sample; trainers do
it after a stage that moves the weights abruptly), ``del opt.state[p]``, or an entry
replaced (``state["exp_avg"] = torch.zeros_like(...)``). Eager's next ``step()`` starts
that state afresh or reads the new tensor. Before 2026-11-30 a jitted step (and
``compile_step``) went on with the state it kept, silently: its losses left eager's from the
first call after the change. Reassigning the dict (``opt.state = defaultdict(dict)``) and
``load_state_dict`` were followed already and are kept here as references.

On the eager backend every comparison is bit for bit: the same ops in the same order.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc

OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    # SGD and Adam: functacc's own update of their state; RMSprop, NAdam: their step() traced.
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01),
}


def _replace_entries(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step":
                state[key] = torch.zeros_like(value)


def _reassign(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.state = defaultdict(dict)


CHANGES: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Any]] = {
    "clear": lambda model, opt: opt.state.clear(),
    "del_one": lambda model, opt: opt.state.pop(model[0].weight),
    "empty_one": lambda model, opt: opt.state.__setitem__(model[2].bias, {}),
    "entries_replaced": _replace_entries,
    "step_replaced": lambda model, opt: [
        s.__setitem__("step", torch.zeros_like(s["step"])) for s in opt.state.values()
    ],
    "reassigned": _reassign,  # followed before 2026-11-30 too
}


def batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def make(optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, OPTIMIZERS[optimizer](model)


def train(
    optimizer: str, change: str, front: str, backend: str = "eager"
) -> tuple[list[torch.Tensor], nn.Module, torch.optim.Optimizer, Any]:
    """Four steps, the change, four more; ``front``: "eager", "jit" or "compile_step"."""
    model, opt = make(optimizer)

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    step: Any = body
    if front == "jit":
        step = functacc.jit(body, modules=[model], optimizers=[opt], backend=backend)
    elif front == "compile_step":
        step = functacc.compile_step(model, F.cross_entropy, opt, backend=backend)
    losses = []
    for i, (x, y) in enumerate(batches()):
        if i == 4:
            CHANGES[change](model, opt)
        losses.append(step(x, y))
    return losses, model, opt, step


def assert_same_training(run: tuple, reference: tuple) -> None:
    losses, model, opt, _ = run
    ref_losses, ref_model, ref_opt, _ = reference
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert torch.equal(a, b), f"loss of call {i}: {a.item()} != eager's {b.item()}"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for i in state:
        assert state[i].keys() == ref_state[i].keys(), i
        for key in state[i]:
            assert torch.equal(torch.as_tensor(state[i][key]), torch.as_tensor(ref_state[i][key]))


@pytest.mark.parametrize(
    ("optimizer", "change"),
    # SGD keeps no step count
    [(o, c) for o in OPTIMIZERS for c in CHANGES if (o, c) != ("sgd_momentum", "step_replaced")],
)
def test_a_state_changed_between_calls_is_read_as_eager_reads_it(optimizer: str, change: str):
    run = train(optimizer, change, "jit")
    assert_same_training(run, train(optimizer, change, "eager"))
    assert len(run[3].traces) == 1  # new state tensors are new inputs, not a new graph


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam", "rmsprop"])
def test_compile_step_follows_a_cleared_state(optimizer: str):
    assert_same_training(
        train(optimizer, "clear", "compile_step"), train(optimizer, "clear", "eager")
    )


def test_a_cleared_state_under_inductor():
    # Inductor reorders and fuses the update's arithmetic: float32 rounding, not more.
    losses, model, _, _ = train("adam", "clear", "jit", backend="inductor")
    ref_losses, ref_model, _, _ = train("adam", "clear", "eager")
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class EpisodicAdapter:
    """Test-time adaptation written as such code is (a TENT-style episodic adapter): before
    each sample the adapted layer is put back with ``load_state_dict`` and the optimizer
    restarted with ``state.clear()``; two steps of entropy minimization on the sample."""

    def __init__(self, model: nn.Module, jit: bool):
        self.model = model
        self.optimizer = torch.optim.Adam(model[2].parameters(), lr=1e-2)
        self.initial = copy.deepcopy(model[2].state_dict())
        self.step: Any = self._step
        if jit:
            self.step = functacc.jit(
                self._step, modules=[model], optimizers=[self.optimizer], backend="eager"
            )

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.model(x).softmax(1)
        entropy = -(probs * probs.log()).sum(1).mean()
        self.optimizer.zero_grad(set_to_none=True)
        entropy.backward()
        self.optimizer.step()
        return entropy.detach()

    def reset(self) -> None:
        self.model[2].load_state_dict(self.initial)
        self.optimizer.state.clear()

    def adapt_and_predict(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        self.reset()
        entropies = [self.step(x) for _ in range(2)]
        with torch.no_grad():
            return entropies, self.model(x)


def test_episodic_test_time_adaptation_restarts_its_optimizer_for_each_sample():
    samples = [x for x, _ in batches(3)]
    results = []
    for jit in (False, True):
        model, _ = make("adam")
        adapter = EpisodicAdapter(model, jit)
        results.append([adapter.adapt_and_predict(x) for x in samples])
    for (entropies, pred), (ref_entropies, ref_pred) in zip(*results[::-1], strict=True):
        assert all(map(torch.equal, entropies, ref_entropies)), (entropies, ref_entropies)
        assert torch.equal(pred, ref_pred)
