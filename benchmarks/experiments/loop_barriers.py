"""A bench model's functacc step with and without OpenMP barriers between independent loop
nests (functacc/backends/inductor/independent_loops.py), two builds in one process, timed
interleaved::

    python benchmarks/experiments/loop_barriers.py                 # the MLP, 500 steps x 9 rounds
    python benchmarks/experiments/loop_barriers.py transformer 30 7

"A" compiles with Inductor's barriers (the change turned off, and its own cache key so
that neither build is served the other's code), "B" as functacc compiles by default. Both
start from the same weights and see the same batches; the script prints whether their
parameters are still equal bit for bit (with deterministic algorithms, since Inductor's
scatter-adds of an embedding's gradient are atomic and differ from run to run) and each
build's ms per step.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

import functacc
import functacc.backends.inductor.compile as inductor
from functacc.bench.models import build


def main(name: str = "mlp", steps: int = 500, rounds: int = 9) -> None:
    torch.set_flush_denormal(True)  # as the bench: a converged MLP is full of denormals
    torch.use_deterministic_algorithms(True)
    nowait, key = inductor.independent_loops_nowait, inductor.CpuPasses.uuid
    builds = {}
    for tag in ("A", "B"):
        barriers = tag == "A"
        inductor.independent_loops_nowait = contextlib.nullcontext if barriers else nowait
        inductor.CpuPasses.uuid = (lambda self: key(self) + b"barriers") if barriers else key
        torch.manual_seed(0)
        w = build(name)
        step = functacc.compile_step(w.model, w.loss_fn, w.make_opt(w.model))
        builds[tag] = (step, w.cycle(), w.model)
    inductor.independent_loops_nowait, inductor.CpuPasses.uuid = nowait, key
    for i in range(31):  # compiles, then warm-up; dropout reseeded so both draw alike
        for step, batches, _ in builds.values():
            torch.manual_seed(i)
            step(*next(batches))
    a, b = (list(model.state_dict().values()) for *_, model in builds.values())
    equal = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    print(f"{name}: parameters equal bit for bit after 31 steps: {equal}")
    times: dict[str, list[float]] = {tag: [] for tag in builds}
    for _ in range(rounds):
        for tag, (step, batches, _) in builds.items():
            start = time.perf_counter()
            for _ in range(steps):
                step(*next(batches))
            times[tag].append((time.perf_counter() - start) / steps * 1e3)
    for tag, t in times.items():
        t.sort()
        print(f"{tag}: median {t[rounds // 2]:.4f} ms/step, best {t[0]:.4f}")
    ratio = sorted(times["B"])[rounds // 2] / sorted(times["A"])[rounds // 2]
    print(f"B / A (median): {ratio:.3f}")


if __name__ == "__main__":
    main(*(f(v) for f, v in zip((str, int, int), sys.argv[1:], strict=False)))
