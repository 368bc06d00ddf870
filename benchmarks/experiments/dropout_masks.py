"""Dropout masks in bytes (functacc/backends/inductor/masks.py) against the float masks eager keeps.

Trains the bench Transformer (4 x d256, dropout 0.1) with eager PyTorch, functacc, and
functacc with the byte-mask pass turned off, interleaved in one process, and prints
throughput and peak step memory::

    python benchmarks/experiments/dropout_masks.py
"""

from __future__ import annotations

import torch

import functacc.backends.inductor.masks as masks
from functacc.bench import competitors, runner
from functacc.bench.cli import warm_inductor
from functacc.bench.models import build


def float_masks(workload):
    """functacc as it was before masks.py: the trace's float masks, unchanged."""
    keep = masks.draw_masks_as_bytes
    masks.draw_masks_as_bytes = lambda gm: 0
    try:
        competitor = competitors.functacc_variant(workload, "float masks")
        competitor.step()  # traces and compiles without the pass
    finally:
        masks.draw_masks_as_bytes = keep
    return competitor


def main() -> None:
    warm_inductor("cpu")
    workload = build("transformer")
    factories = [
        lambda: competitors.make("eager", workload),
        lambda: competitors.make("functacc", workload),
        lambda: float_masks(workload),
    ]
    results = runner.run(
        factories, batch_size=16, device=torch.device("cpu"), warmup=2, steps=5, rounds=9
    )
    eager = results[0].samples_per_s
    for r in results:
        print(
            f"{r.name:22s} {r.samples_per_s:7.1f} samples/s ({r.samples_per_s / eager:.2f}x "
            f"eager)  peak {r.peak_memory_bytes / 2**20:6.1f} MiB"
        )


if __name__ == "__main__":
    main()
