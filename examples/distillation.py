"""Knowledge distillation: a frozen teacher in eval mode beside the student, one step body
compiled whole by ``functacc.jit``.

The teacher runs under ``torch.no_grad()`` (its BatchNorm statistics frozen by eval mode),
the student trains on a mix of the teacher's softened outputs and the labels. The script
trains the same student eagerly from the same start and prints both losses and the speed-up.

    python examples/distillation.py                  # Inductor, 100 steps
    python examples/distillation.py --backend eager  # the traced graph run op by op
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _race import arguments, race
from torch import nn

import functacc


def mlp(width: int, depth: int, classes: int = 10, features: int = 64) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(features if i == 0 else width, width), nn.BatchNorm1d(width)]
        layers += [nn.ReLU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def build(seed: int = 0) -> tuple:
    """A wide teacher (frozen, eval mode), a small student and the student's AdamW."""
    torch.manual_seed(seed)
    teacher = mlp(512, 3).eval().requires_grad_(False)
    student = mlp(128, 2)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.01)
    return student, teacher, opt


def make_step(student, teacher, opt, *, temperature: float = 4.0, alpha: float = 0.9):
    """The distillation loss of Hinton et al.: KL to the softened teacher plus cross-entropy."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            soft_targets = F.softmax(teacher(x) / temperature, dim=-1)
        logits = student(x)
        distill = F.kl_div(
            F.log_softmax(logits / temperature, dim=-1), soft_targets, reduction="batchmean"
        )
        loss = alpha * temperature**2 * distill + (1 - alpha) * F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return train_step


def batches(steps: int, batch: int = 128, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, batch, 64, generator=g)
    return list(zip(x, torch.randint(0, 10, (steps, batch), generator=g), strict=True))


def main() -> None:
    args = arguments(__doc__, steps=100)
    student, teacher, opt = build()
    reference = copy.deepcopy((student, teacher, opt))
    step = functacc.jit(
        make_step(student, teacher, opt),
        modules=[student, teacher],
        optimizers=[opt],
        backend=args.backend,
    )
    eager = make_step(*reference)
    race(
        {"functacc.jit": lambda b: step(*b), "eager": lambda b: eager(*b)},
        batches(args.steps),
        lambda loss: f"loss {loss.item():.4f}",
        step,
    )


if __name__ == "__main__":
    main()
