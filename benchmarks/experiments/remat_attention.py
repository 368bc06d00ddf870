"""The recomputation policies on the bench Transformer, interleaved in one process::

    python benchmarks/experiments/remat_attention.py

``save_matmuls`` keeps every matmul's result from forward, attention's ``bmm``s included;
``selective`` keeps only those with a weight operand and recomputes attention's.
"""

from __future__ import annotations

import torch

from functacc.bench import competitors, runner
from functacc.bench.cli import REMAT_DEFAULTS, warm_inductor
from functacc.bench.models import build
from functacc.transforms.remat import POLICIES


def main() -> None:
    warm_inductor("cpu")
    workload = build("transformer")
    blocks = REMAT_DEFAULTS["transformer"]

    def variant(label, **options):
        def make():
            competitor = competitors.functacc_variant(workload, label, **options)
            competitor.step()  # traces and compiles before the timed rounds
            return competitor

        return make

    factories = [variant("no remat")]
    factories += [variant(p, remat=blocks, remat_policy=p) for p in POLICIES]
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
