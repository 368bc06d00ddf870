"""Why the bench cycles through a pool of batches: denormal floats on this CPU.

Prints a matmul on normal against denormal values, then the bench MLP's eager step time on
one fixed batch against the pool of 64 (the fixed batch is memorised and its gradients
underflow), and the eager step over a long run on the pool (Adam's moments of parameters
whose gradient is exactly zero decay into denormals)::

    python benchmarks/experiments/denormals.py
"""

from __future__ import annotations

import dataclasses
import time

import torch

from functacc.bench.competitors import Eager
from functacc.bench.models import build

TINY = torch.finfo(torch.float32).tiny


def per_call(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def denormal_moments(opt: torch.optim.Optimizer) -> int:
    values = [v for s in opt.state.values() for v in s.values() if v.is_floating_point()]
    return sum(int(((v != 0) & (v.abs() < TINY)).sum()) for v in values)


def main() -> None:
    w = torch.randn(256, 256) * 0.06
    normal, denormal = torch.randn(32, 256), torch.full((32, 256), 1e-39)
    for name, x in (("normal", normal), ("denormal", denormal)):
        us = per_call(lambda x=x: x @ w, 200) * 1e6
        print(f"mm 32x256 @ 256x256, {name} values: {us:.0f} us")

    workload = build("mlp")
    fixed = Eager(dataclasses.replace(workload, batches=[(workload.inputs, workload.targets)]))
    pooled = Eager(workload)
    for label, loop in (("one fixed batch", fixed), ("pool of 64", pooled)):
        for _ in range(300):  # the bench's warm-up and rounds run about this many steps
            loss = loop.step()
        ms = per_call(loop.step, 100) * 1e3
        print(f"MLP eager, {label}: loss {float(loss):.1e}, {ms:.2f} ms/step after 300 steps")

    long = Eager(workload)
    for step in range(1, 1201):
        long.step()
        if step % 300 == 0:
            ms = per_call(long.step, 50) * 1e3
            print(
                f"MLP eager on the pool, step {step}: {ms:.2f} ms/step, "
                f"{denormal_moments(long.opt)} denormal Adam moments"
            )


if __name__ == "__main__":
    main()
