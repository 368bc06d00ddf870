"""``background_compile=True``: the first steps run the traced graph while a worker compiles.

The contract: before the swap, each step is what ``backend="eager"`` computes (the graph as
traced, PyTorch's kernels: bit for bit); the swap loads the worker's compile from Inductor's
cache (cache hits, no compile in this process); after it, the step is Inductor's, within
the tolerance every Inductor parity test uses (1e-5: fused kernels sum in another order). A
worker that fails costs time, never correctness.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from torch import nn

import functacc
import functacc.backends.compile_worker as compile_worker

EXACT = {"rtol": 0.0, "atol": 0.0}
FUSED = {"rtol": 1e-5, "atol": 1e-6}


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batches(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def build(front: str, model, opt, **options):
    if front == "compile_step":
        return functacc.compile_step(model, nn.MSELoss(), opt, **options)

    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return functacc.jit(train_step, modules=[model], optimizers=[opt], **options)


def train(step, data, *, swap_at: int | None = None, start: int = 0) -> list[torch.Tensor]:
    losses = []
    for i, (x, y) in enumerate(data, start):
        if i == swap_at:
            step.wait_for_compile()
        torch.manual_seed(100 + i)  # step i draws the same dropout masks in every run
        losses.append(step(x, y))
    return losses


@pytest.mark.inductor
def test_the_first_steps_run_as_traced_then_the_workers_compile(tmp_path, monkeypatch) -> None:
    # jit here, compile_step below (each worker's compile costs about 20 s on 2 cores).
    from torch._dynamo.utils import counters

    front = "jit"

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    data = batches()
    model, opt = mlp()
    step = build(front, model, opt, background_compile=True)
    counters.clear()
    before = train(step, data[:3])
    # A new Python process has not even imported torch in three small steps.
    (pending,) = step._engine.engine._pending
    assert pending.pending and pending.steps_before == 3
    assert step.wait_for_compile() > 0 and not pending.pending
    # Both graphs (gradients, update) came from the worker's cache entries.
    assert counters["aot_autograd"]["autograd_cache_hit"] == 2, dict(counters["aot_autograd"])
    assert counters["aot_autograd"].get("autograd_cache_miss", 0) == 0
    after = train(step, data[3:], start=3)
    assert step.num_traces == 1

    eager_model, eager_opt = mlp()
    eager = train(build(front, eager_model, eager_opt, backend="eager"), data)
    assert_close(before, eager[:3], **EXACT, what="losses before the swap")
    assert_close(after, eager[3:], **FUSED, what="losses after the swap")
    assert_close(model.state_dict(), eager_model.state_dict(), **FUSED, what="parameters")


@pytest.mark.inductor
def test_a_failing_worker_costs_time_not_correctness(tmp_path, monkeypatch) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    real_spawn = compile_worker.spawn
    # Each graph sent with no example inputs: the worker fails at its first compile.
    monkeypatch.setattr(
        compile_worker,
        "spawn",
        lambda graphs, options: real_spawn([(g, []) for g, _ in graphs], options),
    )
    data = batches(4)
    model, opt = mlp()
    step = build("compile_step", model, opt, background_compile=True, dynamic=False)
    # Two shapes warmed up: the second graph compiles here, before its first call, while
    # the first one's workers run (one background compile at a time).
    g = torch.Generator().manual_seed(2)
    other = (torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g))
    step.warmup([data[0], other], progress=False)
    assert step.num_traces == 2 and len(step._jitted._engine.engine._pending) == 1
    counters.clear()
    # The workers fail within seconds, maybe before the first step: whenever the swap comes,
    # this process compiles the graphs itself and the steps are Inductor's.
    losses = train(step, data, swap_at=2)
    assert counters["aot_autograd"]["autograd_cache_miss"] >= 1, dict(counters["aot_autograd"])
    eager_model, eager_opt = mlp()
    eager = train(build("compile_step", eager_model, eager_opt, backend="eager"), data)
    assert_close(losses, eager, **FUSED, what="losses")
    assert_close(model.state_dict(), eager_model.state_dict(), **FUSED, what="parameters")


def test_background_compile_is_checked_up_front() -> None:
    model, opt = mlp()
    with pytest.raises(ValueError, match="background_compile=True was given with backend='eager'"):
        functacc.compile_step(model, nn.MSELoss(), opt, backend="eager", background_compile=True)
    with pytest.raises(TypeError, match="background_compile must be True or False; got 'yes'"):
        build("jit", model, opt, background_compile="yes")
    # Without background compiles there is nothing to wait for.
    step = build("jit", model, opt, backend="eager")
    step(*batches(1)[0])
    assert step.wait_for_compile() == 0.0


def test_a_step_with_collectives_is_not_compiled_in_the_background() -> None:
    # Each rank's worker would finish at another step, and ranks must run the same code at
    # every step: a graph with collectives compiles before its first call.
    from functacc.backends.compile import _collectives

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(
        graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    )
    assert _collectives(torch.fx.GraphModule({}, graph))
    plain = torch.fx.Graph()
    plain.output(plain.call_function(torch.ops.aten.relu.default, (plain.placeholder("x"),)))
    assert not _collectives(torch.fx.GraphModule({}, plain))
