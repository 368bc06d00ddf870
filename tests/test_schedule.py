"""The collective-scheduling pass: it reorders, never changes what is computed."""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from functacc.parallel.schedule import issue_collectives_early


def fake_collective_graph():
    """A graph shaped like a step: two "gradients", each reduced with an all-reduce whose
    result is used at the end. The collective ops are the real _c10d_functional ones, traced
    on fake tensors (no process group needed for tracing)."""

    def step(a, b):
        h = (a * 2).sin()  # backward: h feeds the first gradient and the rest of backward
        g1 = h * 3  # the last layer's gradient: ready first
        g2 = (h + b).cos().exp()  # ready later
        r1 = torch.ops._c10d_functional.all_reduce.default(g1 * 0.5, "sum", "fake")
        r2 = torch.ops._c10d_functional.all_reduce.default(g2 * 0.5, "sum", "fake")
        w1 = torch.ops._c10d_functional.wait_tensor.default(r1)
        w2 = torch.ops._c10d_functional.wait_tensor.default(r2)
        return operator.add(w1, w2)  # the optimizer update uses both

    return make_fx(step, tracing_mode="fake")(torch.randn(4), torch.randn(4))


def order(gm):
    return [
        str(n.target).split(".")[-2] if n.op == "call_function" else n.op for n in gm.graph.nodes
    ]


def test_reductions_start_early_and_waits_move_late() -> None:
    gm = fake_collective_graph()
    before = order(gm)
    moved = issue_collectives_early(gm)
    after = order(gm)
    assert moved > 0 and sorted(before) == sorted(after)
    # Originally both reductions followed all the compute; now the first starts before the
    # second gradient is computed ...
    assert before.index("all_reduce") > before.index("exp")
    assert after.index("all_reduce") < after.index("cos")
    # ... and the waits come just before the update, after both reductions started.
    last_reduce = max(i for i, op in enumerate(after) if op == "all_reduce")
    assert min(i for i, op in enumerate(after) if op == "wait_tensor") > last_reduce
    gm.graph.lint()  # still topologically ordered


def test_graph_without_collectives_is_untouched() -> None:
    gm = make_fx(lambda x: x.sin() + 1, tracing_mode="fake")(torch.randn(3))
    before = order(gm)
    assert issue_collectives_early(gm) == 0 and order(gm) == before
