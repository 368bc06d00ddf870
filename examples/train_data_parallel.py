"""Data-parallel training with functacc under torchrun.

    torchrun --nproc_per_node=2 examples/train_data_parallel.py
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE --master_addr=$HEAD \\
        examples/train_data_parallel.py --epochs 90          # a cluster

Each rank trains on its own slice of the data (DeviceLoader); gradient all-reduces are part
of the compiled step. Rank 0 logs the global throughput.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn

import functacc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512, help="synthetic dataset size")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args()

    functacc.init_distributed()  # reads torchrun's environment; a no-op for `python ...`
    rank, world = functacc.parallel.rank(), functacc.parallel.world_size()
    torch.manual_seed(0)
    images = torch.randn(args.samples, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.samples,))
    dataset = torch.utils.data.TensorDataset(images, labels)
    loader = functacc.DeviceLoader(
        torch.utils.data.DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, drop_last=True
        )
    )

    model = torchvision.models.resnet18(num_classes=10).to(loader.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend=args.backend)

    for epoch in range(args.epochs):
        start = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            loss = step(x, y)
            sched.step()
            if i == 0 and epoch == 0:
                start = time.perf_counter()  # the first step compiles
        elapsed = time.perf_counter() - start
        measured = len(loader) - (1 if epoch == 0 else 0)
        throughput = measured * args.batch_size * world / max(elapsed, 1e-9)
        if rank == 0:
            strategy = step.stats()["strategy"]
            print(
                f"Epoch: {epoch}, Step: {len(loader)}, Loss: {float(loss):.4f}, "
                f"Throughputs: {throughput:.1f} samples/s ({world} ranks, {strategy})"
            )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
