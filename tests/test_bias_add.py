"""A linear layer's bias added after its matmul on CPU (functacc/backends/inductor/bias_add.py):
rewritten where the sum is the same (float32, a 1-D bias, alpha = beta = 1), the same values,
and what an Inductor step runs."""

from __future__ import annotations

import uuid

import pytest
import torch
from helpers import assert_adamw_step_matches_eager, assert_close
from models import mlp
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from functacc.backends.inductor.bias_add import BiasAfterMatmul

# As the parity tests: Inductor's fused kernels sum in another order than eager's.
INDUCTOR = {"rtol": 1e-4, "atol": 1e-5}
aten = torch.ops.aten


def _count(gm: torch.fx.GraphModule, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


def _rewritten(fn, *inputs) -> tuple[torch.fx.GraphModule, int]:
    gm = make_fx(fn)(*inputs)
    done = BiasAfterMatmul()(gm.graph)
    gm.recompile()
    return gm, done


@pytest.mark.parametrize("after", ["gelu through views", "log_softmax"])
def test_bias_moves_after_the_matmul(after: str) -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 5, 8), torch.randn(7, 8), torch.randn(7)

    def layer(x, w, b):
        y = nn.functional.linear(x, w, b)  # a 3-D input: addmm on its 2-D view
        return nn.functional.gelu(y) if after.startswith("gelu") else torch.log_softmax(y, -1)

    gm, done = _rewritten(layer, x, w, b)
    assert done == 1 and _count(gm, aten.addmm.default) == 0
    assert _count(gm, aten.mm.default) == 1
    # Same op, another order of one addition at most: float32 rounding of a sum of 8.
    assert_close(gm(x, w, b), layer(x, w, b), rtol=1e-6, atol=1e-6, what="output")


@pytest.mark.parametrize("case", ["bf16", "beta", "full-size input"])
def test_addmm_kept_where_the_bias_cannot_follow(case: str) -> None:
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    if case == "bf16":  # mm rounded to bf16 before the add would round twice
        x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()

        def fn(x, w, b):
            return torch.relu(torch.addmm(b, x, w.t()))

    elif case == "beta":

        def fn(x, w, b):
            return torch.relu(torch.addmm(b, x, w.t(), beta=0.5))

    else:  # the added matrix is no bias broadcast over rows
        b = torch.randn(4, 3)

        def fn(x, w, b):
            return torch.relu(torch.addmm(b, x, w.t()))

    gm, done = _rewritten(fn, x, w, b)
    assert done == 0 and _count(gm, aten.addmm.default) == 1


@pytest.mark.inductor
def test_an_inductor_step_adds_biases_in_its_kernels(monkeypatch) -> None:
    # A fresh cache key, so that Inductor compiles and runs the pass in this process.
    key = uuid.uuid4().bytes
    monkeypatch.setattr(BiasAfterMatmul, "uuid", lambda self: key)
    counts: list[int] = []
    original = BiasAfterMatmul.__call__
    monkeypatch.setattr(
        BiasAfterMatmul, "__call__", lambda self, g: counts.append(original(self, g)) or 0
    )
    torch.manual_seed(0)
    assert_adamw_step_matches_eager(mlp(), **INDUCTOR)
    # Two hidden layers and the classifier: every bias of the forward.
    assert 3 in counts, f"biases moved per compiled graph: {counts}"
