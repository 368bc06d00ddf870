"""Where one compiled training step spends its time: the bench's workload through
``functacc.compile_step``, a few warm-up steps, then ``torch.profiler`` over the next ones,
the kernels sorted by device time (CPU ops on a machine without CUDA).

    python benchmarks/gpu/profile_step.py --model resnet50 --image-size 224 --batch-size 64
    python benchmarks/gpu/profile_step.py --model mlp --device cpu --steps 3   # a dry run
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from functacc.bench.competitors import Functacc
from functacc.bench.models import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    sizes = {"image_size": args.image_size} if "resnet" in args.model else {}
    w = build(args.model, batch_size=args.batch_size, device=args.device, **sizes)
    step = Functacc(w)
    for _ in range(3):  # compile, capture, replay
        step.step()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step.step()
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(f"{w.description}; {args.steps} steps on {args.device}, sorted by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))


if __name__ == "__main__":
    main()
