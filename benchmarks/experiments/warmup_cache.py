"""Warm-up cost with and without Inductor's on-disk cache.

Warms three buckets (32, 64, 128 tokens) of a small Hugging Face GPT-2 step
(``dynamic=False``, one static graph per bucket) and prints the time. Run it twice with the
same fresh cache directory: the first run compiles, the second finds the cache::

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    python benchmarks/experiments/warmup_cache.py   # cold
    python benchmarks/experiments/warmup_cache.py   # a second process
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import models  # the test suite's small random-weight GPT-2

import functacc


def main() -> None:
    torch.manual_seed(0)
    model = models.gpt2(layers=2, dim=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = functacc.compile_step(model, None, opt, dynamic=False)
    g = torch.Generator().manual_seed(0)
    batches = [models.padded_text_batch([n] * 4, generator=g) for n in (32, 64, 128)]
    start = time.perf_counter()
    records = step.warmup(batches, progress=False)
    per_graph = ", ".join(f"{r.trace_s:.1f}+{r.compile_s:.1f}" for r in records)
    print(
        f"warm-up of {len(records)} buckets: {time.perf_counter() - start:.1f} s "
        f"(trace+compile per graph: {per_graph})"
    )


if __name__ == "__main__":
    main()
