"""Sizes and model of the TorchAcc-style examples: small enough for a 2-core CPU by default,
the TorchAcc documentation's sizes with --full (ResNet-50, 224x224, batch 64, 6400 samples)."""

from __future__ import annotations

import argparse

import torch
import torchvision


def sizes() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--full", action="store_true", help="the documentation's sizes (GPU)")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--log-steps", type=int, default=None)
    p.add_argument(
        "--arch",
        default="resnet50",
        help="a torchvision ResNet name, or resnet10: ResNet-18 with one block per stage "
        "(the tests' size)",
    )
    args = p.parse_args()
    full = {"samples": 6400, "batch_size": 64, "image_size": 224, "epochs": 2, "log_steps": 20}
    small = {"samples": 320, "batch_size": 16, "image_size": 64, "epochs": 2, "log_steps": 5}
    for key, value in (full if args.full else small).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def resnet(arch: str, num_classes: int = 100) -> torch.nn.Module:
    """The torchvision ResNet named ``arch`` with a ``num_classes`` head. ``"resnet10"`` is
    torchvision's ResNet-18 with one residual block per stage instead of two: the same
    modules and API, half the layers (and half the compile on a 2-core CPU)."""
    if arch == "resnet10":
        block = torchvision.models.resnet.BasicBlock
        model = torchvision.models.resnet.ResNet(block, [1, 1, 1, 1])
    else:
        model = getattr(torchvision.models, arch)()
    model.fc = torch.nn.Linear(model.fc.in_features, num_classes)
    return model
