"""Inductor's generated code called directly (functacc/backends/inductor/call.py): it must return
what the wrappers it skips return, keep them where they have work to do, and be what a step
runs."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_adamw_step_matches_eager, assert_close
from models import mlp
from torch.fx.experimental.proxy_tensor import make_fx

import functacc
import functacc.backends.inductor.compile
from functacc.backends.inductor.call import direct_call

pytestmark = pytest.mark.inductor

EXACT = {"rtol": 0.0, "atol": 0.0}
# As the parity tests: Inductor's fused kernels sum in another order than eager's.
INDUCTOR = {"rtol": 1e-4, "atol": 1e-5}


def _compile(fn, inputs):
    """``fn`` traced and compiled as functacc compiles a static graph: ``(gm, compiled)``,
    ``compiled`` being what Inductor returns, with its wrappers."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = make_fx(fn)(*inputs)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t.detach(), static_shapes=True) for t in inputs]
    with tracing(TracingContext(mode)):
        compiled = compile_fx(copy.deepcopy(gm), fakes)
    return gm, compiled


def _conv_linear(x, w, v):
    y = torch.nn.functional.conv1d(x, w).relu().flatten(1) @ v
    return y.sum(), y.t()  # an output that is a view of another


def test_direct_call_returns_what_the_wrappers_return() -> None:
    # Inputs that require grad (the step's parameters do), called with grad mode off as the
    # step calls its graphs (``compile.Compiled``). Ambient autocast: the convolution and
    # matmul stay float32, as the wrappers keep them (torch 2.14's autocast does not reach
    # the kernels Inductor calls; the direct call turns it off all the same).
    torch.manual_seed(0)
    x, w = torch.randn(8, 3, 16), torch.randn(4, 3, 5, requires_grad=True)
    v = torch.randn(48, 6, requires_grad=True)
    gm, compiled = _compile(_conv_linear, [x, w.detach(), v.detach()])
    run = direct_call(compiled, gm, [x, w, v])
    assert run is not None, "a plain static graph must be called directly"
    for autocast in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            args = [x, w, v]
            got = run(args)
            want = compiled(x, w, v)
        assert args == [], "the generated code empties its input list (frees inputs early)"
        assert [t.dtype for t in got] == [torch.float32, torch.float32]
        assert not any(t.requires_grad for t in got)
        assert_close(list(got), list(want), **EXACT, what="direct vs wrapped")


def test_wrappers_are_kept_where_they_have_work() -> None:
    x = torch.randn(4, 4)
    # Two inputs sharing memory (AOTAutograd may merge them into one base).
    gm, compiled = _compile(lambda a, b: a + b, [x, x.t()])
    assert direct_call(compiled, gm, [x, x.t()]) is None
    # A graph that changes an input's strides (replayed outside the graph).
    gm, compiled = _compile(lambda a: a.t_().sum(), [torch.randn(2, 3)])
    assert direct_call(compiled, gm, [torch.randn(2, 3)]) is None
    # A graph holding a constant tensor (AOTAutograd passes it in front of the inputs).
    constant = torch.arange(4.0)
    gm, compiled = _compile(lambda a: a * constant, [torch.randn(4)])
    assert next(gm.buffers(), None) is not None or next(gm.parameters(), None) is not None
    assert direct_call(compiled, gm, [torch.randn(4)]) is None


def test_a_step_runs_its_graphs_directly_and_matches_eager(monkeypatch) -> None:
    # What the bench measures: both graphs of an MLP step called directly; the step still
    # equal to eager PyTorch within Inductor's tolerance.
    made = []

    def spy(compiled, gm, inputs):
        run = direct_call(compiled, gm, inputs)
        made.append(run is not None)
        return run

    monkeypatch.setattr(functacc.backends.inductor.compile, "direct_call", spy)
    torch.manual_seed(0)
    assert_adamw_step_matches_eager(mlp(), **INDUCTOR)
    assert made == [True, True], f"gradients and update graphs called directly: {made}"


@pytest.mark.inductor
def test_a_cpp_wrapper_step_matches_eager(tmp_path, monkeypatch) -> None:
    # inductor_options={"cpp_wrapper": True}: Inductor generates C++ for the graphs' calls
    # too, and compiles each graph from its placeholders' values where any has one (the
    # update's slot placeholder once had one, and the other inputs came out as None). An
    # empty cache: a graph found there is not compiled, and would not fail.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    assert_adamw_step_matches_eager(mlp(), **INDUCTOR, inductor_options={"cpp_wrapper": True})


def test_docstring_example() -> None:
    import doctest

    import functacc.backends.inductor.call

    assert doctest.testmod(functacc.backends.inductor.call).attempted > 0
    assert doctest.testmod(functacc.backends.inductor.call).failed == 0
