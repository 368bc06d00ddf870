"""Hooks on the step's modules that write Python state, through ``functacc.jit``, against eager.

Distillation with hint losses (FitNets), perceptual losses and activation logging catch
intermediate outputs with forward hooks, written as code does: a hook factory whose
closure holds the dict (``feats[name] = output``) the loss then reads, hooks bound to an
extractor object, a hook appending each output to a list kept for later. The hooks'
closures are the step's Python state as the body's are: a dict or list a hook and the body
share is one recording copy while traced, and what a hook wrote is written after each call,
as eager leaves it.

Before 2026-11-29 the first failed (``KeyError: 's'``: the body read a copy that the hook's
closure did not see) and the list of the third silently kept the trace's fake tensors.
With ``backend="eager"`` losses, weights and what the hooks left are compared bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def distill_with_hooks(how: str) -> tuple:
    """A student trained on labels and on the teacher's middle layer, caught by hooks."""
    torch.manual_seed(0)
    teacher, student = mlp().eval(), mlp()
    teacher.requires_grad_(False)
    kept: list[torch.Tensor] = []
    if how == "closure":
        feats: dict[str, torch.Tensor] = {}

        def save(name: str):
            def hook(module, inputs, output):
                feats[name] = output

            return hook

        teacher[2].register_forward_hook(save("t"))
        student[2].register_forward_hook(save("s"))
        features = lambda: feats  # noqa: E731 (the body reads the dict the hooks fill)
    else:

        class Extractor:
            def __init__(self) -> None:
                self.features: dict[str, torch.Tensor] = {}

            def hook(self, name: str):
                return lambda module, inputs, output: self.features.__setitem__(name, output)

        extractor = Extractor()
        teacher[2].register_forward_hook(extractor.hook("t"))
        student[2].register_forward_hook(extractor.hook("s"))
        features = lambda: extractor.features  # noqa: E731
    student[4].register_forward_hook(lambda module, inputs, output: kept.append(output.detach()))
    opt = torch.optim.SGD(student.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher(x)
        logits = student(x)
        hint = F.mse_loss(features()["s"], features()["t"])
        loss = F.cross_entropy(logits, y) + hint
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step, teacher, student, opt, features, kept


def run(how: str, backend: str | None) -> tuple:
    step, teacher, student, opt, features, kept = distill_with_hooks(how)
    if backend is not None:
        step = functacc.jit(step, modules=[teacher, student], optimizers=[opt], backend=backend)
    g = torch.Generator().manual_seed(1)
    losses = [
        step(torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g))
        for _ in range(4)
    ]
    return losses, copy.deepcopy(student.state_dict()), dict(features()), list(kept), step


@pytest.mark.parametrize("how", ["closure", "extractor"])
def test_feature_hooks_writing_python_state_run_as_in_eager(how: str) -> None:
    losses, weights, features, kept, step = run(how, "eager")
    eager_losses, eager_weights, eager_features, eager_kept, _ = run(how, None)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    assert all(torch.equal(v, eager_weights[k]) for k, v in weights.items())
    # what the hooks left after the last call: the real tensors of that call, as eager's
    assert features.keys() == eager_features.keys() == {"s", "t"}
    assert all(type(v) is torch.Tensor for v in [*features.values(), *kept])
    assert all(torch.equal(v, eager_features[k]) for k, v in features.items())
    assert len(kept) == len(eager_kept) == 4
    assert all(torch.equal(a, b) for a, b in zip(kept, eager_kept, strict=True))
    assert step.num_traces == 1


def test_feature_hooks_under_inductor() -> None:
    losses, weights, features, kept, _ = run("closure", "inductor")
    eager_losses, eager_weights, eager_features, eager_kept, _ = run("closure", None)
    # Inductor's fused kernels round differently from eager's: float32, four steps
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(features, eager_features, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept, eager_kept, rtol=1e-5, atol=1e-6)
