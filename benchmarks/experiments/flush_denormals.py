"""Long CPU runs and denormal Adam moments: ``torch.set_flush_denormal(True)`` at start-up.

Adam's moments of a parameter whose gradient is exactly zero (a dead ReLU unit) decay into
denormal floats after about 600 steps and stay there (a moment of one denormal unit times
0.9 rounds back to one unit), and every later step pays this CPU's slow path on them. The
bench MLP, eager and functacc, each without flushing denormals to zero, flushing from
start-up, and flushing switched on after the first step; one fresh process per run.
Flushing must be switched on before the first parallel region: OpenMP's worker threads
copy the caller's floating-point mode when they start, and only then::

    python benchmarks/experiments/flush_denormals.py            # 3000 steps per run
    python benchmarks/experiments/flush_denormals.py 6000
"""

from __future__ import annotations

import subprocess
import sys
import time

LOG_EVERY = 500


FLUSH = ("off", "from start-up", "after the first step")


def run(competitor: str, flush: str, steps: int) -> None:
    """One run, in this process: the bench MLP for ``steps`` steps on the bench's pool."""
    import torch

    if flush == FLUSH[1]:
        assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    from functacc.bench import competitors
    from functacc.bench.models import build

    loop = competitors.make(competitor, build("mlp"))
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss = loop.step()
        if step == 1 and flush == FLUSH[2]:  # the OpenMP threads exist by now
            assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
        if step % LOG_EVERY == 0:
            ms = (time.perf_counter() - start) / LOG_EVERY * 1e3
            print(
                f"  steps {step - LOG_EVERY + 1}-{step}: {ms:.2f} ms/step, loss {float(loss):.3f}"
            )
            start = time.perf_counter()


def main(steps: int = 3000) -> None:
    for competitor in ("eager", "functacc"):
        for flush in FLUSH:
            print(f"{competitor}, flush denormals {flush}:", flush=True)
            args = [sys.executable, __file__, "--run", competitor, flush, str(steps)]
            subprocess.run(args, check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main(*map(int, sys.argv[1:2]))
