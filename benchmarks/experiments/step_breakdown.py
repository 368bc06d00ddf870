"""Where a bench model's functacc step spends its wall time, per step, without a profiler
(its per-event cost would be as large as the small parts measured here)::

    python benchmarks/experiments/step_breakdown.py            # the MLP
    python benchmarks/experiments/step_breakdown.py transformer 300

Parts: the step's own Python before the graphs run (signature check, program lookup), the
two compiled graphs (gradients, update) as Inductor's generated code runs them, the
wrappers around each graph (functacc's grad-mode and autocast switch; where functacc keeps
them, Inductor's ``CompiledFxGraph``, AOTAutograd's runtime wrapper, Dynamo's disable), freeing what
the graphs returned, and the rest. It wraps private functacc and Inductor functions with
timers (about 0.1 us each), so it is a measurement script, not an API.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from torch._inductor.output_code import CompiledFxGraph

import functacc
import functacc.backends.inductor.call as inductor_call
import functacc.backends.split as split
from functacc.bench.models import build

clock = time.perf_counter
spent: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def run(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += clock() - start

    return run


def main(name: str = "mlp", steps: int = 1000) -> None:
    torch.set_flush_denormal(True)  # as the bench does (README, "denormals")
    call = CompiledFxGraph.__call__
    graphs: dict[int, float] = {}  # per graph, in the order they first ran

    def timed_graph(self, inputs):
        start = clock()
        try:
            return call(self, inputs)
        finally:
            graphs[id(self)] = graphs.get(id(self), 0.0) + clock() - start

    CompiledFxGraph.__call__ = timed_graph
    # Where functacc calls the generated code directly (functacc/backends/inductor/call.py), time it
    # there: the direct caller reads ``current_callable`` from what this returns.
    output_codes = inductor_call._output_codes

    def timed_codes(compiled):
        found = output_codes(compiled)
        for code in found:
            code.current_callable = timed_code(code, code.current_callable)
        return found

    def timed_code(code, call):
        def run(inputs):
            start = clock()
            try:
                return call(inputs)
            finally:
                graphs[id(code)] = graphs.get(id(code), 0.0) + clock() - start

        return run

    inductor_call._output_codes = timed_codes
    runner = split.Split.runner

    def timed_runner(self, gradients, update):
        run = runner(self, timed("gradients", gradients), timed("update", update))

        def whole(args):
            start = clock()
            outputs = run(args)  # its locals (the gradients) are freed when it returns
            spent["run"] += clock() - start
            return outputs

        return whole

    split.Split.runner = timed_runner
    workload = build(name)
    step = functacc.compile_step(
        workload.model, workload.loss_fn, workload.make_opt(workload.model)
    )
    body = step._jitted._engine  # the program lookup of each call
    body.program = timed("program", body.program)
    batches = workload.cycle()
    for _ in range(50):
        step(*next(batches))
    for _ in range(3):
        spent.clear()
        graphs.clear()
        start = clock()
        for _ in range(steps):
            step(*next(batches))
        total = (clock() - start) / steps * 1e3
        per = {k: v / steps * 1e3 for k, v in spent.items()}
        each = [v / steps * 1e3 for v in graphs.values()]
        wrappers = per["gradients"] + per["update"] - sum(each)
        freeing = per["run"] - per["gradients"] - per["update"]
        rest = total - per["run"] - per["program"]
        parts = " + ".join(f"{t:.3f}" for t in each)
        print(
            f"{name}: {total:.3f} ms/step = step's Python before the graphs "
            f"{per['program']:.3f} + graphs {parts} + their wrappers "
            f"{wrappers:.3f} + runner glue and freeing the gradients {freeing:.3f} "
            f"+ rest {rest:.3f}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
