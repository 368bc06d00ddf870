"""WGAN-GP on synthetic 2-D data: two models, two optimizers, a gradient penalty through
``torch.autograd.grad(..., create_graph=True)``, compiled whole by ``functacc.jit``.

The step body below is plain eager PyTorch; ``functacc.jit`` traces it once (both updates,
the double backward of the penalty, both Adam updates) into one graph. The script trains
the same models eagerly from the same start and prints both losses and the speed-up.

    python examples/wgan_gp.py                  # Inductor, 200 steps
    python examples/wgan_gp.py --backend eager  # the traced graph run op by op (bit for bit)
"""

from __future__ import annotations

import copy

import torch
from _race import arguments, race
from torch import nn

import functacc


def build(seed: int = 0, *, noise: int = 16, data: int = 2, hidden: int = 128) -> tuple:
    """Generator, critic and their Adam optimizers (the WGAN-GP paper's betas)."""
    torch.manual_seed(seed)
    generator = nn.Sequential(
        nn.Linear(noise, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, data),
    )  # fmt: skip
    critic = nn.Sequential(
        nn.Linear(data, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
        nn.LeakyReLU(0.2), nn.Linear(hidden, 1),
    )  # fmt: skip
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    return generator, critic, opt_g, opt_c


def make_step(generator, critic, opt_g, opt_c, *, penalty: float = 10.0):
    """One critic update and one generator update, as an eager training loop writes them."""

    def train_step(real: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Critic: Wasserstein loss plus the gradient penalty on random interpolates.
        opt_c.zero_grad()
        fake = generator(z).detach()
        alpha = torch.rand(real.shape[0], 1, device=real.device)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
        gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        loss_c = critic(fake).mean() - critic(real).mean() + penalty * gp
        loss_c.backward()
        opt_c.step()
        # Generator: the critic is frozen meanwhile, so no gradient reaches its weights.
        opt_g.zero_grad()
        for p in critic.parameters():
            p.requires_grad_(False)
        loss_g = -critic(generator(z)).mean()
        loss_g.backward()
        for p in critic.parameters():
            p.requires_grad_(True)
        opt_g.step()
        return loss_c.detach(), loss_g.detach()

    return train_step


def batches(steps: int, batch: int = 256, noise: int = 16, seed: int = 1) -> list:
    """Real samples from a ring of eight Gaussians, and the generator's noise."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, 8, (steps, batch, 1), generator=g) * (torch.pi / 4)
    ring = torch.cat([angles.cos(), angles.sin()], dim=-1) * 2
    real = ring + 0.02 * torch.randn(ring.shape, generator=g)
    return list(zip(real, torch.randn(steps, batch, noise, generator=g), strict=True))


def main() -> None:
    args = arguments(__doc__, steps=200)
    models = build()
    reference = copy.deepcopy(models)  # the eager run: same weights, same batches, same seed
    step = functacc.jit(
        make_step(*models), modules=models[:2], optimizers=models[2:], backend=args.backend
    )
    eager = make_step(*reference)
    race(
        {"functacc.jit": lambda b: step(*b), "eager": lambda b: eager(*b)},
        batches(args.steps),
        lambda r: f"critic loss {r[0].item():.4f}, generator loss {r[1].item():.4f}",
        step,
    )


if __name__ == "__main__":
    main()
