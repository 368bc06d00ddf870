"""A small training job for the checkpoint tests, run in fresh processes.

python ckpt_job.py MODE DIR STEPS      MODE: full | first | resume | kill_while_saving
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import models

import functacc

BACKEND = os.environ.get("BACKEND", "eager")
# RMSprop (no twin): compile_step's standard body on jit's pipeline; PRECISION=fp16 adds a
# GradScaler whose scale the checkpoint carries.
OPTIMIZER = os.environ.get("OPTIMIZER", "AdamW")
PRECISION = os.environ.get("PRECISION") or None


def build():
    torch.manual_seed(0)
    model = models.cnn_bn()  # BatchNorm and dropout
    if OPTIMIZER == "AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(40, 3, 16, 16, generator=g), torch.randint(0, 5, (40,), generator=g)
    )
    loader = functacc.DeviceLoader(
        torch.utils.data.DataLoader(data, batch_size=8, shuffle=True), device="cpu"
    )
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, backend=BACKEND, precision=PRECISION
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, loader, step, sched


def train(step, loader, sched, steps: int) -> list[float]:
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            losses.append(float(step(x, y)))
            sched.step()
            if len(losses) == steps:
                break
    return losses


def main() -> None:
    mode, directory, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, opt, loader, step, sched = build()
    states = {"scheduler": sched}
    if mode == "resume":
        functacc.load(step, os.path.join(directory, "ckpt"), loader=loader, states=states)
    if mode == "kill_while_saving":
        manager = functacc.CheckpointManager(directory, every_steps=2, loader=loader)
        train(step, loader, sched, 2)
        manager.maybe_save(step)  # complete
        train(step, loader, sched, 2)
        from torch.distributed.checkpoint import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner)  # the data files are written ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... and the process dies before metadata

        FileSystemWriter.write_data = write_then_die
        manager.maybe_save(step)
        return
    losses = train(step, loader, sched, steps)
    if mode == "first":
        functacc.save(step, os.path.join(directory, "ckpt"), loader=loader, states=states)
    torch.save(
        {
            "losses": losses,
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "scale": step.loss_scale,
            "skipped": step.skipped_steps,
            "count": step.count,
        },
        os.path.join(directory, f"{mode}.pt"),
    )


if __name__ == "__main__":
    main()
