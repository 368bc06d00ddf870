"""kornia's GPU augmentations called in a jitted step: a clear error whose advice works.

``aug = K.AugmentationSequential(K.RandomHorizontalFlip(), K.ColorJitter(...),
K.RandomResizedCrop(...))`` keeps its samplers' bounds as tensors inside
``torch.distributions``-style objects its modules hold (``ColorJitter``'s
``brightness_sampler.low``), which functacc does not feed to the graph. Before 2026-11-28
the error advised giving the module in ``modules=``, which it was; it now names those
tensors and says to augment the batch before the call, which gives eager's numbers.
"""

from __future__ import annotations

import kornia.augmentation as K
import pytest
import torch
from torch import nn

import functacc


def setup() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    aug = K.AugmentationSequential(
        K.RandomHorizontalFlip(p=0.5),
        K.ColorJitter(0.2, 0.2, 0.2, 0.1, p=0.8),
        K.RandomResizedCrop((16, 16), scale=(0.5, 1.0)),
    )
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    net.append(nn.Linear(8, 10))
    return aug, net, torch.optim.SGD(net.parameters(), lr=0.1)


def test_kornia_augmentation_in_the_step_is_an_error_whose_advice_gives_eagers_numbers() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))]
    batches *= 3
    aug, net, opt = setup()

    def as_written(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = aug(x)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    before, rng = [p.detach().clone() for p in net.parameters()], torch.get_rng_state()
    step = functacc.jit(as_written, modules=[net, aug], optimizers=opt, backend="eager")
    with pytest.raises(functacc.TraceError, match=r"(?s)brightness_sampler.*before the call"):
        step(*batches[0])
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)

    def run(jit: bool) -> torch.Tensor:
        aug, net, opt = setup()

        def advised(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        step = (
            functacc.jit(advised, modules=net, optimizers=opt, backend="eager") if jit else advised
        )
        torch.manual_seed(2)  # the augmentations' draws
        return torch.stack([step(aug(x), y) for x, y in batches])

    assert torch.equal(run(True), run(False))
