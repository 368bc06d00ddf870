"""What a bench model's step costs outside its compiled graph, and how much of it is the
per-call model check (functacc/core/guards.py), on a step built with the eager backend (no
compile: the host work is the same)::

    python benchmarks/experiments/host_overhead.py resnet50
"""

from __future__ import annotations

import sys
import timeit

from functacc.bench.competitors import Functacc
from functacc.bench.models import build


def main(name: str = "resnet50") -> None:
    competitor = Functacc(build(name), backend="eager")
    competitor.step()
    watch = competitor.compiled._model_watch
    calls = 20000
    check = min(timeit.repeat(watch.key, number=calls, repeat=5)) / calls
    host = min(competitor.host_overhead_s() for _ in range(3))
    print(
        f"{name}: {len(watch.modules)} modules, {len(watch.params)} parameters; model check "
        f"{check * 1e6:.1f} us, whole step outside its graph {host * 1e6:.1f} us per call"
    )


if __name__ == "__main__":
    main(*sys.argv[1:2])
