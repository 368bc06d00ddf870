"""ResNet training on synthetic data: the eager loop, then the same loop with functacc.

This is `make demo`. Both runs start from the same weights and see the same batches; the
script prints TorchAcc-style log lines and the throughput of each, then their ratio.

    python examples/resnet_quickstart.py                       # resnet18, 32x32, CPU-sized
    python examples/resnet_quickstart.py --model resnet50 --image-size 224 --batch-size 64
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torchvision
from torch import nn

import functacc


def synthetic_loader(steps: int, batch_size: int, image_size: int, classes: int, device):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=g).to(device)
    for _ in range(steps):
        yield images, torch.randint(0, classes, (batch_size,), generator=g).to(device)


def train(name: str, step_fn, loader, *, log_every: int, batch_size: int) -> float:
    """Run the loop; return samples/s over the steps after the first (which compiles)."""
    start = last = time.perf_counter()
    for i, (images, labels) in enumerate(loader, start=1):
        loss = step_fn(images, labels)
        if i == 1:
            first = time.perf_counter() - start
            print(f"[{name}] first step (includes compilation): {first:.1f} s")
            start = last = time.perf_counter()
        elif i % log_every == 0:
            now = time.perf_counter()
            throughput = log_every * batch_size / (now - last)
            last = now
            print(
                f"[{name}] Epoch: 0, Step: {i}, Loss: {float(loss):.4f}, "
                f"Throughputs: {throughput:.1f} samples/s"
            )
    return (i - 1) * batch_size / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10).to(device)
    functacc_model = copy.deepcopy(model)
    criterion = nn.CrossEntropyLoss()
    sizes = {"batch_size": args.batch_size, "image_size": args.image_size, "classes": 10}

    # 1. The eager loop.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def eager_step(images, labels):
        optimizer.zero_grad()
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    loader = synthetic_loader(args.steps, device=device, **sizes)
    eager = train("eager", eager_step, loader, log_every=args.log_every, batch_size=args.batch_size)

    # 2. The same loop, with the whole step compiled by functacc.
    optimizer = torch.optim.SGD(
        functacc_model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4
    )
    step = functacc.compile_step(functacc_model, criterion, optimizer, backend=args.backend)
    loader = synthetic_loader(args.steps, device=device, **sizes)
    fast = train("functacc", step, loader, log_every=args.log_every, batch_size=args.batch_size)

    print(
        f"\n{args.model} {args.image_size}x{args.image_size}, batch {args.batch_size}, "
        f"{device}: eager {eager:.1f} samples/s, functacc {fast:.1f} samples/s "
        f"({fast / eager:.2f}x)"
    )


if __name__ == "__main__":
    main()
