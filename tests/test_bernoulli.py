"""functacc's dropout-mask kernel (functacc/backends/inductor/bernoulli.py) against eager's
``bernoulli_``: the same bytes, and the generator left in the same state, bit for bit."""

from __future__ import annotations

import pytest
import torch

from functacc.backends.inductor import bernoulli

pytestmark = pytest.mark.skipif(
    not bernoulli.available(), reason="the kernel needs a C++ compiler (Inductor's)"
)

# Sizes around MT19937's 624-word block (312 elements of two words each) and large ones;
# draws before the mask put the generator at odd and even positions within a block.
SIZES = [1, 2, 311, 312, 313, 623, 624, 625, 4096, 100_003]


@pytest.mark.parametrize("before", [0, 1, 5, 624])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.7, 0.9, 1.0])
def test_masks_and_generator_state_are_eagers(p: float, before: int) -> None:
    for size in SIZES:
        torch.manual_seed(size)
        torch.rand(before)
        expected = torch.empty(size, dtype=torch.uint8).bernoulli_(p)
        state, after = torch.get_rng_state(), torch.rand(4)
        torch.manual_seed(size)
        torch.rand(before)
        actual = bernoulli.draw_bytes([size], p)
        assert torch.equal(actual, expected), f"size {size}"
        assert torch.equal(torch.get_rng_state(), state), f"generator state, size {size}"
        assert torch.equal(torch.rand(4), after)


def test_the_operator_draws_the_same_and_traces_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    expected = torch.empty(64, 80, dtype=torch.uint8).bernoulli_(0.3)
    torch.manual_seed(0)
    assert torch.equal(bernoulli.OP([64, 80], 0.3), expected)
    state = torch.get_rng_state()
    with FakeTensorMode():
        fake = bernoulli.OP([64, 80], 0.3)
    assert fake.shape == (64, 80) and fake.dtype == torch.uint8
    assert torch.equal(torch.get_rng_state(), state), "tracing draws nothing"


def test_a_probability_outside_0_1_is_refused_like_eager() -> None:
    with pytest.raises(RuntimeError):
        torch.empty(4, dtype=torch.uint8).bernoulli_(1.5)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="0 <= p <= 1"):
        bernoulli.draw_bytes([4], 1.5)
    assert torch.equal(torch.get_rng_state(), state)


def test_without_a_compiler_the_kernel_is_unavailable_and_masks_keep_eagers_draw(
    monkeypatch, caplog
) -> None:
    import logging

    import torch._inductor.cpp_builder as cpp_builder
    from torch.fx.experimental.proxy_tensor import make_fx

    from functacc.backends.inductor.masks import draw_masks_as_bytes

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "/nonexistent/c++")
    bernoulli._kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="functacc"):
            assert not bernoulli.available()
        assert "could not be built" in caplog.text
        with pytest.raises(RuntimeError, match="not available"):
            bernoulli.draw_bytes([8], 0.5)

        def dropout(x):
            return x * torch.empty_like(x).bernoulli_(0.7).div_(0.7)

        x = torch.randn(64, 100)
        gm = make_fx(dropout)(x)
        assert draw_masks_as_bytes(gm) == 1
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert bernoulli.OP not in targets and torch.ops.aten.bernoulli_.float in targets
        torch.manual_seed(5)
        expected = dropout(x)
        torch.manual_seed(5)
        assert torch.equal(gm(x), expected)
    finally:
        monkeypatch.undo()
        bernoulli._kernel.cache_clear()
    assert bernoulli.available()
