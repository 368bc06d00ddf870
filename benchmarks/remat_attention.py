"""Recomputation policies on the bench Transformer, and one that is not a policy yet.

``save_matmuls`` keeps every matmul's result from forward, attention's ``bmm``s included;
the last row keeps only ``mm``/``addmm`` (the layers' weights) and recomputes attention.
All interleaved in one process::

    python benchmarks/remat_attention.py
"""

from __future__ import annotations

import torch

import functacc.remat
from functacc.bench import competitors, runner
from functacc.bench.cli import REMAT_DEFAULTS, warm_inductor
from functacc.bench.models import build

WEIGHT_MATMULS = tuple(
    op
    for op in functacc.remat._MATMULS
    if op not in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)
)


def variant(workload, label, matmuls=None, **options):
    def make():
        keep = functacc.remat._MATMULS
        functacc.remat._MATMULS = matmuls or keep
        try:
            competitor = competitors.functacc_variant(workload, label, **options)
            competitor.step()  # traces and compiles with these matmuls kept
        finally:
            functacc.remat._MATMULS = keep
        return competitor

    return make


def main() -> None:
    warm_inductor("cpu")
    workload = build("transformer")
    blocks = REMAT_DEFAULTS["transformer"]
    factories = [
        variant(workload, "no remat"),
        variant(workload, "full", remat=blocks, remat_policy="full"),
        variant(workload, "save_matmuls", remat=blocks, remat_policy="save_matmuls"),
        variant(
            workload,
            "weight matmuls only",
            WEIGHT_MATMULS,
            remat=blocks,
            remat_policy="save_matmuls",
        ),
    ]
    results = runner.run(
        factories, batch_size=16, device=torch.device("cpu"), warmup=2, steps=5, rounds=7
    )
    base = results[0]
    for r in results:
        print(
            f"{r.name:32s} {r.samples_per_s:7.1f} samples/s "
            f"({r.samples_per_s / base.samples_per_s:.2f}x)  peak "
            f"{r.peak_memory_bytes / 2**20:6.1f} MiB "
            f"({r.peak_memory_bytes / base.peak_memory_bytes:.2f}x)"
        )


if __name__ == "__main__":
    main()
