"""Inductor's input size checks in one call before the first kernel
(functacc/backends/inductor/input_checks.py): what the generated code checks, and that a wrong
input fails before anything is written."""

from __future__ import annotations

import re
import uuid

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from torch.fx.experimental.proxy_tensor import make_fx

import functacc
from functacc import _compat
from functacc.backends.inductor.call import _output_codes
from functacc.backends.inductor.input_checks import input_checks_first


def write_then_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor]:
    # Two kernels and an extern matmul between them: Inductor on its own checks each input
    # just before the first of them that reads it.
    a.mul_(2)
    return (b @ (c * a.sum()),)


def _compiled(patched: bool):
    # A fresh Inductor config each time, so that neither build comes from the other's cache
    # entry (the patch changes only code generation, not the cache key).
    examples = [torch.randn(8, 8), torch.randn(4, 8), torch.randn(8, 3)]
    gm = make_fx(write_then_matmul)(*examples)
    salt = {"fx_graph_cache": False}
    with torch._inductor.config.patch(salt):
        if patched:
            with input_checks_first():
                compiled = compile_fx(gm, examples)
        else:
            compiled = compile_fx(gm, examples)
    (code,) = _output_codes(compiled)
    return compiled, code.source_code


def _call_body(source: str) -> str:
    return source[source.index("def call(") :]


def _checks_then_first_kernel(body: str) -> tuple[list[int], int]:
    """Where the size checks of a ``call()`` body start, and where its first kernel does."""
    checks = [m.start() for m in re.finditer(r"assert_size_stride\w*\(", body)]
    kernel = re.search(r"cpp_fused\w*\(|extern_kernels\.\w+\(", body)
    assert kernel is not None, body[:2000]
    return checks, kernel.start()


@pytest.mark.inductor
def test_every_input_is_checked_in_one_call_before_the_first_kernel() -> None:
    _, plain = _compiled(patched=False)
    _, first = _compiled(patched=True)
    body = _call_body(first)
    checks, kernel = _checks_then_first_kernel(body)
    assert checks and max(checks) < kernel
    # The same inputs as Inductor's own placement checks, with the same sizes.
    for name, sizes in (("arg0_1", "(8, 8)"), ("arg1_1", "(4, 8)"), ("arg2_1", "(8, 3)")):
        assert re.search(rf"assert_size_stride\w*\(.*\b{name}\b", body[:kernel])
        assert sizes in plain and sizes in body
    if not _compat.inductor_defers_input_checks():
        # torch 2.11 writes one check per input, all before the first kernel: its own
        # placement is already what the patch makes, and the patch leaves it alone.
        assert len(checks) == 3 and body == _call_body(plain)
        return
    assert len(checks) == 1, checks
    assert body.startswith("assert_size_stride_grouped((", checks[0])
    for kernel_name in ("cpp_fused", "extern_kernels.mm"):
        assert checks[0] < body.index(kernel_name), kernel_name
    # Without the patch: a check before each kernel.
    plain_body = _call_body(plain)
    assert len(re.findall(r"assert_size_stride\w*\(", plain_body)) > 1


@pytest.mark.inductor
def test_a_wrong_input_still_fails_the_check_and_nothing_is_written() -> None:
    # The matmul's input, read by no generated kernel: were it left out of the one check,
    # ATen's matmul would fail instead, with a RuntimeError, after the first kernel ran.
    compiled, _ = _compiled(patched=True)
    a = torch.ones(8, 8)
    with pytest.raises(AssertionError, match="size"):
        compiled(a, torch.randn(4, 7), torch.randn(8, 3))  # b: 7 columns, not 8
    assert torch.equal(a, torch.ones(8, 8))  # not doubled
    out = compiled(a, torch.randn(4, 8), torch.randn(8, 3))
    assert out[0].shape == (4, 3) and torch.equal(a, torch.full((8, 8), 2.0))


@pytest.mark.inductor
def test_a_cpu_step_checks_its_inputs_once_per_graph(tmp_path, monkeypatch) -> None:
    # The bench MLP's shape of step: forward reads each layer's weights just before its
    # matmul, the update reads every state tensor; each graph checks its inputs in one call.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / uuid.uuid4().hex))
    found = []
    real = functacc.backends.inductor.call._output_codes

    def keep(compiled):
        codes = real(compiled)
        found.extend(codes)
        return codes

    monkeypatch.setattr(functacc.backends.inductor.call, "_output_codes", keep)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = functacc.compile_step(model, torch.nn.MSELoss(), opt)
    step(torch.randn(4, 16), torch.randn(4, 16))
    assert len(found) == 2  # the gradients graph and the update graph
    for code in found:
        body = _call_body(code.source_code)
        checks, kernel = _checks_then_first_kernel(body)
        assert checks and max(checks) < kernel, body[:2000]
        if _compat.inductor_defers_input_checks():
            assert len(checks) == 1, body[:2000]
        # (torch 2.11: one check per input, all at the start, as Inductor writes them)
