"""ResNet training on synthetic data: the eager loop and the same loop with functacc.

This is `make demo`. Both start from the same weights and see the same batches. After
functacc's first step (which traces and compiles the whole training step), the two loops
take turns, `--log-every` steps each, so that both are measured under the same conditions;
each block prints a TorchAcc-style log line, and the summary gives the median throughputs.

    python examples/resnet_quickstart.py                       # ResNet-18, 32x32, CPU-sized
    python examples/resnet_quickstart.py --model resnet50 --batch-size 16
    python examples/resnet_quickstart.py --model resnet50 --image-size 224 --batch-size 64  # GPU
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torchvision
from torch import nn

import functacc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=60, help="timed steps per loop")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10).to(device)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    labels = torch.randint(0, 10, (args.steps + 1, args.batch_size), generator=g)
    images, labels = images.to(device), labels.to(device)

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)

    # 1. The eager loop.
    eager_model = copy.deepcopy(model)
    optimizer = sgd(eager_model)

    def eager_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = criterion(eager_model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    # 2. The same step, compiled whole by functacc.
    step = functacc.compile_step(model, criterion, sgd(model), backend=args.backend)

    start = time.perf_counter()
    step(images, labels[0])
    eager_step(images, labels[0])
    print(
        f"[functacc] first step (traces and compiles the whole step): "
        f"{time.perf_counter() - start:.1f} s"
    )

    rates: dict[str, list[float]] = {"eager": [], "functacc": []}
    done = 0
    while done < args.steps:
        n = min(args.log_every, args.steps - done)
        for name, fn in (("eager", eager_step), ("functacc", step)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(done + 1, done + n + 1):
                loss = fn(images, labels[i])
            if device == "cuda":
                torch.cuda.synchronize()
            rate = n * args.batch_size / (time.perf_counter() - start)
            rates[name].append(rate)
            print(
                f"[{name}] Epoch: 0, Step: {done + n}, Loss: {float(loss):.4f}, "
                f"Throughputs: {rate:.1f} samples/s"
            )
        done += n

    eager, fast = statistics.median(rates["eager"]), statistics.median(rates["functacc"])
    print(
        f"\n{args.model} {args.image_size}x{args.image_size}, batch {args.batch_size}, {device}: "
        f"eager {eager:.1f} samples/s, functacc {fast:.1f} samples/s ({fast / eager:.2f}x)"
    )


if __name__ == "__main__":
    main()
