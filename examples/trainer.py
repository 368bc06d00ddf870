"""A trainer class, as training code is often written, compiled whole by ``functacc.jit``.

``Trainer.train_step`` is ordinary eager code that keeps Python state: it counts its steps
in ``self.step``, seeds each step's dropout from that count, clips the gradients, steps the
optimizer and a ``OneCycleLR`` schedule, and returns ``loss.item()`` with the learning rate.
``functacc.jit`` traces it once; on every call the counter, the seed, the schedule and the
returned numbers are what the eager method gives (the loop's history list stays outside).
The script trains the same model eagerly from the same start and prints both.

    python examples/trainer.py                  # Inductor, 50 steps
    python examples/trainer.py --backend eager  # the traced graph run op by op
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _race import arguments, race
from torch import nn

import functacc


class Trainer:
    def __init__(self, model: nn.Module, total_steps: int, seed: int = 0):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.opt, max_lr=1e-2, total_steps=total_steps
        )
        self.seed = seed
        self.step = 0
        self.max_grad_norm = 1.0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        self.step += 1
        torch.manual_seed(self.seed + self.step)  # each step's dropout masks, reproducible
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.scheduler.step()
        return loss.item(), self.scheduler.get_last_lr()[0]


def build(total_steps: int, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
    # normalise into updates of the learning rate's size (noise, in eager as anywhere).
    model = nn.Sequential(
        nn.Linear(32, 128, bias=False),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(128, 10),
    )
    return Trainer(model, total_steps, seed)


def jitted(trainer: Trainer, backend: str = "inductor") -> functacc.Jitted:
    return functacc.jit(
        trainer.train_step, modules=[trainer.model], optimizers=[trainer.opt], backend=backend
    )


def batches(steps: int, batch: int = 64, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, batch, 32, generator=g)
    return list(zip(x, torch.randint(0, 10, (steps, batch), generator=g), strict=True))


def main() -> None:
    args = arguments(__doc__, steps=50)
    trainer, reference = build(args.steps), build(args.steps)  # the same start
    step = jitted(trainer, args.backend)
    history: list[tuple[float, float]] = []  # kept by the loop, outside the step

    def compiled(batch: tuple) -> tuple[float, float]:
        history.append(step(*batch))
        return history[-1]

    race(
        {"functacc.jit": compiled, "eager": lambda b: reference.train_step(*b)},
        batches(args.steps),
        lambda out: f"loss {out[0]:.4f}, lr {out[1]:.2e}",
        step,
    )
    print(f"trainer.step {trainer.step} (eager {reference.step}), {len(history)} losses logged")


if __name__ == "__main__":
    main()
