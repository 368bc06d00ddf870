"""functacc's Inductor settings for CPU graphs (functacc/backends/inductor/compile.py), seen in
the code Inductor generates."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functacc.backends.compile
import functacc.backends.inductor.compile
from functacc.backends.inductor.call import _output_codes

pytestmark = pytest.mark.inductor


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 or more CPU threads")
def test_small_kernels_run_on_one_thread(monkeypatch) -> None:
    # 4096 elements per thread: below the 8192 per thread that functacc asks for, one
    # thread; 32768 per thread: OpenMP's parallel region (sizes scale with the thread count,
    # which Inductor reads when it compiles).
    threads = torch.get_num_threads()
    compiled = []
    real = functacc.backends.inductor.compile.direct_call

    def spy(fn, gm, inputs):
        compiled.append(fn)
        return real(fn, gm, inputs)

    monkeypatch.setattr(functacc.backends.inductor.compile, "direct_call", spy)
    parallel = {}
    small, large = 4096 * threads, 32768 * threads
    for size in (small, large):
        x = torch.randn(size)
        gm = make_fx(lambda a: torch.relu(a) * 2)(x)
        run = functacc.backends.compile.compile_graph(gm, [x], "inductor")
        assert torch.equal(run([x.clone()])[0], torch.relu(x) * 2)
        (code,) = _output_codes(compiled[-1])
        parallel[size] = "#pragma omp parallel" in code.source_code
    assert parallel == {small: False, large: True}, parallel
