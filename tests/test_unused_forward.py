"""A forward whose result the step drops still has its effects, as in eager.

PyTorch-GAN's ``relativistic_gan.py`` computes ``fake_pred = discriminator(gen_imgs)`` and
then overwrites the loss that used it: eager runs that forward anyway, so BatchNorm's
running statistics take one more update and Dropout draws its masks from torch's generator.
Before 2026-11-28 functacc dropped that forward from the graph: ``native_batch_norm``'s
schema does not mark the running statistics it writes, so the unread op looked pure. The
running statistics then differed from eager's, silently (the losses, computed in training
mode, did not show it); under Inductor the unused forward's dropout draw went too, and every
later mask was another one.

Tolerance: bit for bit on the eager backend; Inductor's own kernels round the running
statistics' update their own way (within 1e-6), its dropout masks are eager's (the losses
equal within 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import functacc


def run(jit: bool, backend: str, dropout: bool) -> tuple[list[float], dict, torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, 1, 1), nn.LeakyReLU(0.2)]
    layers += [nn.Dropout2d(0.25)] if dropout else []
    model = nn.Sequential(*layers, nn.BatchNorm2d(8, 0.8), nn.Flatten(), nn.Linear(8 * 16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        unused = model(x)  # noqa: F841 (computed and dropped, as relativistic_gan's fake_pred)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    if jit:
        step = functacc.jit(step, modules=[model], optimizers=[opt], backend=backend)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, 4, 4, generator=g) for _ in range(3)]
    torch.manual_seed(2)
    losses = [step(x).item() for x in batches]
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


@pytest.mark.parametrize("dropout", [False, True], ids=["batchnorm", "dropout+batchnorm"])
def test_an_unused_forward_updates_batchnorm_and_draws_as_in_eager(dropout: bool) -> None:
    eager, jitted = run(False, "eager", dropout), run(True, "eager", dropout)
    assert jitted[0] == eager[0]
    assert all(torch.equal(jitted[1][k], v) for k, v in eager[1].items())
    assert torch.equal(jitted[2], eager[2])


@pytest.mark.inductor
def test_an_unused_forward_under_inductor() -> None:
    eager, jitted = run(False, "eager", True), run(True, "inductor", True)
    torch.testing.assert_close(jitted[0], eager[0], rtol=1e-6, atol=1e-6)
    for k, v in eager[1].items():
        torch.testing.assert_close(jitted[1][k], v, rtol=1e-5, atol=1e-6)
    assert torch.equal(jitted[2], eager[2])
