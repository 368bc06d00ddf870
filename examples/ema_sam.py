"""Sharpness-aware minimisation (SAM) with an exponential moving average of the weights:
two forward/backward passes per step, an in-place weight perturbation between them, and an
in-place EMA update after ``opt.step()``, all in one graph by ``functacc.jit``.

    python examples/ema_sam.py                  # Inductor, 100 steps
    python examples/ema_sam.py --backend eager  # the traced graph run op by op
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _race import arguments, race
from torch import nn

import functacc


def build(seed: int = 0) -> tuple:
    """A small convolutional classifier, its EMA copy (never trained directly) and SGD."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return model, ema, opt


def make_step(model, ema, opt, *, rho: float = 0.05, decay: float = 0.99):
    """SAM (Foret et al.): ascend to the worst nearby weights, take the gradient there,
    step from the original weights; then fold the new weights into the EMA."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        with torch.no_grad():
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.stack([p.grad.norm(2) for p in params]).norm(2)
            shifts = [p.grad * (rho / (norm + 1e-12)) for p in params]
            for p, e in zip(params, shifts, strict=True):
                p.add_(e)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p, e in zip(params, shifts, strict=True):
                p.sub_(e)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
                p_ema.mul_(decay).add_(p, alpha=1 - decay)
            for b_ema, b in zip(ema.buffers(), model.buffers(), strict=True):
                b_ema.copy_(b)
        return loss.detach()

    return train_step


def batches(steps: int, batch: int = 32, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, batch, 3, 16, 16, generator=g)
    return list(zip(x, torch.randint(0, 10, (steps, batch), generator=g), strict=True))


def main() -> None:
    args = arguments(__doc__, steps=100)
    model, ema, opt = build()
    reference = copy.deepcopy((model, ema, opt))
    step = functacc.jit(
        make_step(model, ema, opt), modules=[model, ema], optimizers=[opt], backend=args.backend
    )
    eager = make_step(*reference)
    race(
        {"functacc.jit": lambda b: step(*b), "eager": lambda b: eager(*b)},
        batches(args.steps),
        lambda loss: f"loss {loss.item():.4f}",
        step,
    )
    drift = max(
        (a - b).abs().max().item()
        for a, b in zip(ema.parameters(), reference[1].parameters(), strict=True)
    )
    print(f"EMA weights differ from eager's by at most {drift:.2e}")


if __name__ == "__main__":
    main()
