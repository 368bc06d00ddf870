"""skorch's ``NeuralNet.train_step`` through ``functacc.jit``, against eager.

skorch runs its own loop (``fit``, ``partial_fit``); the step is its ``train_step(batch)``:
``optimizer.step(step_fn)`` with a closure that zeroes the gradients, runs
``train_step_single`` (forward, ``get_loss``, ``backward``) and notifies the callbacks'
``on_grad_computed`` (``GradientNormClipping`` clips there). A user jits it in place:
``net.train_step = functacc.jit(net.train_step, modules=net.module_,
optimizers=net.optimizer_)``. Before 2026-11-28 ``opt.step(closure)`` in a step was a
``ValueError``; torch's optimizers (but LBFGS) call the closure once, first, with grad on,
and so does functacc now. With ``backend="eager"`` the recorded losses and the weights are
compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import GradientNormClipping
from torch import nn

import functacc


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.drop, self.out = nn.Linear(20, 16), nn.Dropout(0.2), nn.Linear(16, 2)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.hidden(X))))


def fit(jit: bool, optimizer: type) -> tuple[list, nn.Module]:
    torch.manual_seed(0)
    rng = np.random.RandomState(0)
    X = rng.randn(200, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    net = NeuralNetClassifier(
        Classifier, max_epochs=3, lr=0.1, batch_size=32, train_split=None, verbose=0,
        optimizer=optimizer, iterator_train__shuffle=False,
        callbacks=[GradientNormClipping(1.0)], criterion=nn.CrossEntropyLoss,
    )  # fmt: skip
    net.initialize()
    if jit:
        net.train_step = functacc.jit(
            net.train_step, modules=net.module_, optimizers=net.optimizer_, backend="eager"
        )
    torch.manual_seed(1)  # the dropout masks
    net.partial_fit(X, y)  # 3 epochs of 7 batches, the last of 8 rows
    return net.history[:, "train_loss"], net.module_


def test_skorchs_train_step_with_its_closure_and_clipping_callback_runs_as_in_eager() -> None:
    for optimizer in (torch.optim.SGD, torch.optim.RMSprop):  # functacc's twin, its own step
        got, module = fit(True, optimizer)
        expected, reference = fit(False, optimizer)
        assert got == expected and len(got) == 3
        for a, b in zip(module.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a, b)
