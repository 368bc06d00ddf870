"""The update graph compiled by a worker process into Inductor's cache.

The worker only fills a cache, so the contract is: the step then finds the update there (a
cache hit, not a second compile) and computes exactly what it computes without a worker
(the same generated code: rtol = atol = 0). A worker that fails costs nothing but time.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import assert_close
from torch import nn

import functacc
import functacc.backends.compile_worker as compile_worker

EXACT = {"rtol": 0.0, "atol": 0.0}


def mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, functacc.compile_step(model, nn.MSELoss(), opt)


def train(step) -> list[torch.Tensor]:
    # The last batch has another size: a retrace, whose update graph is the same one.
    g = torch.Generator().manual_seed(1)
    return [step(torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)) for n in (4, 4, 6)]


@pytest.mark.inductor
def test_the_step_gets_the_update_from_the_worker(tmp_path, monkeypatch) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compile_worker, "MIN_NODES", 0)  # this small graph too
    monkeypatch.setattr(compile_worker, "_started", set())
    started = []
    real_start, real_finish = compile_worker.start_worker, compile_worker.CompileWorker.finish

    def start(*args):
        started.append(real_start(*args))
        return started[-1]

    monkeypatch.setattr(compile_worker, "start_worker", start)
    # Wait for the worker whatever its progress: the hit must not depend on timing here.
    monkeypatch.setattr(compile_worker.CompileWorker, "finish", lambda w: real_finish(w, wait=True))

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "with"))
    counters.clear()
    model, step = mlp_step()
    losses = train(step)
    assert step.num_traces == 2
    # The retrace starts no second worker (this process compiled that update already) and
    # both compiles of the update are cache hits: the worker's entry, then its own.
    assert len(started) == 2 and started[0] is not None and started[1] is None
    assert counters["aot_autograd"]["autograd_cache_hit"] == 2, dict(counters["aot_autograd"])

    monkeypatch.setenv(compile_worker.ENV, "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "without"))
    counters.clear()
    reference_model, reference = mlp_step()
    reference_losses = train(reference)
    assert started[2:] == [None, None]
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1  # the retrace's update only
    assert_close(losses, reference_losses, **EXACT, what="losses")
    assert_close(model.state_dict(), reference_model.state_dict(), **EXACT, what="parameters")


def test_a_failing_worker_reports_and_is_cleaned_up(caplog, monkeypatch) -> None:
    # A job whose inputs do not fit its graph: the worker fails; the caller learns it
    # (and compiles the graph itself), the error is in the debug log, the folder is gone.
    monkeypatch.setattr(compile_worker, "MIN_NODES", 0)
    gm = torch.fx.symbolic_trace(lambda x, y: x + y)
    worker = compile_worker.start_worker(gm, [torch.ones(3)], {})
    assert worker is not None
    folder = worker._folder
    with caplog.at_level(logging.DEBUG, logger="functacc"):
        assert worker.finish(wait=True) is False
    assert "compile worker exited with 1" in caplog.text
    assert "Expected positional argument for parameter y" in caplog.text  # its error
    assert not folder.exists()


def test_no_worker_where_it_cannot_help(monkeypatch) -> None:
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    example = [torch.ones(3)]
    assert compile_worker.start_worker(gm, example, {}) is None  # a small graph
    monkeypatch.setattr(compile_worker, "MIN_NODES", 0)
    monkeypatch.setenv(compile_worker.ENV, "0")
    assert compile_worker.start_worker(gm, example, {}) is None  # turned off
    monkeypatch.setenv(compile_worker.ENV, "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str((os.cpu_count() or 1) * 64))
    assert compile_worker.start_worker(gm, example, {}) is None  # ranks fill the cores
