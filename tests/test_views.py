"""The eager backend runs a traced ``view`` as ``reshape`` unless something writes through it."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from functacc.backends.compile import views_that_may_copy


def test_only_views_of_unwritten_memory_may_copy() -> None:
    def f(x, y):
        a = x.view(-1)
        a.view(2, -1).add_(1)  # written through a view of a view: stays a view
        c = (y * 2).view(4, -1) * 2  # fresh and never written: may copy
        d = y + 1
        e = d.view(-1)
        d.mul_(3)  # its base written after it was taken: stays a view
        return a, c, e

    x, y = torch.randn(4, 6), torch.randn(4, 6)
    gm = make_fx(f)(x.clone(), y)
    assert views_that_may_copy(gm) == 1
    kinds = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert kinds.count(torch.ops.aten.reshape.default) == 1
    assert kinds.count(torch.ops.aten.view.default) == 3
    expected = f(x.clone(), y)
    actual = gm(x.clone(), y)
    assert all(torch.equal(a, b) for a, b in zip(actual, expected, strict=True))


def test_a_view_whose_traced_strides_were_wrong_runs() -> None:
    # elu_backward's meta kernel returns contiguous strides for a transposed gradient; the
    # real kernel returns transposed ones, which the traced view(128, 16) cannot take.
    def grads(x, w):
        h = torch.selu(torch.nn.functional.linear(x.transpose(1, 2), w))
        return torch.autograd.grad(h.transpose(1, 2).mean(dim=2).sum(), [w])

    x, w = torch.randn(8, 8, 16), torch.randn(16, 8, requires_grad=True)
    gm = make_fx(grads, tracing_mode="fake")(x, w)
    views_that_may_copy(gm)
    (expected,) = grads(x, w)
    (actual,) = gm(x, w)
    assert torch.equal(actual, expected)
