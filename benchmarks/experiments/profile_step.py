"""Where a bench model's functacc step spends its time, per step (``torch.profiler`` with
Inductor's kernel profiling on): matmuls, dropout's mask draws, the rest, and the
events that take the most time::

    python benchmarks/experiments/profile_step.py transformer
    python benchmarks/experiments/profile_step.py mlp 200     # steps to profile (default 5)
"""

from __future__ import annotations

import sys

import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

import functacc
from functacc.bench.models import build

TOP = 6
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution")
# Dropout's mask draws: eager's kernel, and functacc's (functacc/backends/inductor/bernoulli.py)
# where it runs.
DRAWS = ("aten::bernoulli_", "functacc::bernoulli_bytes")


def main(name: str = "transformer", steps: int = 5) -> None:
    inductor_config.cpp.enable_kernel_profile = True  # Inductor's kernels as profiler events
    workload = build(name)
    step = functacc.compile_step(
        workload.model, workload.loss_fn, workload.make_opt(workload.model)
    )
    batches = workload.cycle()  # as the bench steps through them
    for _ in range(3):
        step(*next(batches))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(*next(batches))
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / steps / 1e3
    draws = sum(e.self_cpu_time_total for e in events if e.key in DRAWS) / steps / 1e3
    print(
        f"{name}: {total:.1f} ms per step; matmuls {matmul:.1f} ms, mask draws {draws:.1f} ms, "
        f"the rest {total - matmul - draws:.1f} ms"
    )
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP]:
        per_step = e.self_cpu_time_total / steps / 1e3
        print(f"  {per_step:7.3f} ms  {e.count // steps:3d} calls  {e.key[:90]}")


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
