"""Resumable training: checkpoints every N steps, and a restart continues where it stopped.

    torchrun --nproc_per_node=2 --max-restarts=3 examples/train_resumable.py --ckpt ckpt
    python examples/train_resumable.py --ckpt ckpt        # one process; run it twice

Kill it (Ctrl-C, SIGKILL, a lost node) and start it again: it restores the newest complete
checkpoint — parameters, optimizer state, step count, RNG and the loader's position — and
continues bit for bit. torchrun --max-restarts does the restarting by itself. A checkpoint
written with one layout (say --zero 3 on 2 ranks) loads into another (1 process, DP, ZeRO-1).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import functacc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default="checkpoints")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--backend", default="eager", choices=["inductor", "eager"])
    args = p.parse_args()

    functacc.init_distributed()
    rank = functacc.parallel.rank()
    torch.manual_seed(0)
    images, labels = torch.randn(512, 3, 16, 16), torch.randint(0, 10, (512,))
    loader = functacc.DeviceLoader(
        torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(images, labels), batch_size=16, shuffle=True
        )
    )
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(16, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    parallel = functacc.parallel.ZeRO(args.zero) if args.zero else None
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, parallel=parallel, backend=args.backend
    )
    manager = functacc.CheckpointManager(
        args.ckpt, every_steps=args.every, keep=3, loader=loader, states={"scheduler": sched}
    )
    if manager.restore_latest(step) and rank == 0:
        print(f"resumed at step {step.count} (epoch {loader.epoch})")

    while step.count < args.steps:
        for x, y in loader:
            loss = step(x, y)
            sched.step()
            saved = manager.maybe_save(step)
            if rank == 0 and saved:
                print(f"Step: {step.count}, Loss: {float(loss):.4f}, saved {saved}")
            if step.count >= args.steps:
                break
    functacc.save_model(step, f"{args.ckpt}/model.safetensors")  # full weights, for inference
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
