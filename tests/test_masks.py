"""Dropout masks drawn into bytes (functacc/backends/inductor/masks.py): eager's draws, a quarter
of the memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import functacc
from functacc.backends.inductor import bernoulli
from functacc.backends.inductor.masks import draw_masks_as_bytes
from functacc.bench.memory import peak_memory


def dropout_like_eager(x: torch.Tensor) -> torch.Tensor:
    # What eager's CPU dropout runs (aten::dropout's C++ composite), p = 0.3.
    return x * torch.empty_like(x).bernoulli_(0.7).div_(0.7)


LAYOUTS = {
    "contiguous": lambda: torch.randn(6, 5, 4),
    "transposed": lambda: torch.randn(5, 6, 4).transpose(0, 1),
    "permuted": lambda: torch.randn(4, 5, 6).permute(2, 1, 0),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "size_one_dims": lambda: torch.randn(5, 1, 7).transpose(0, 2),
    "empty": lambda: torch.randn(0, 3),
    # 6000 elements: drawn by functacc's kernel (functacc/backends/inductor/bernoulli.py), not
    # eager's; with symbolic sizes only where the buffer is contiguous.
    "large_transposed": lambda: torch.randn(40, 50, 3).transpose(0, 1),
    "large_contiguous": lambda: torch.randn(30, 40, 5),
}


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rewritten_draws_are_eagers_bit_for_bit(layout: str, dtype: torch.dtype, mode: str) -> None:
    x = LAYOUTS[layout]().to(dtype)
    gm = make_fx(dropout_like_eager, tracing_mode=mode)(x)
    assert draw_masks_as_bytes(gm) == 1
    targets = (torch.ops.aten.bernoulli_.float, bernoulli.OP)
    draws = [n for n in gm.graph.nodes if n.target in targets]
    assert [n.meta["val"].dtype for n in draws] == [torch.uint8]
    large = x.numel() >= 4096 and (mode != "symbolic" or x.is_contiguous())
    fast = large and bernoulli.available()
    assert (draws[0].target is bernoulli.OP) == fast
    torch.manual_seed(7)
    expected = dropout_like_eager(x)
    after_eager = torch.rand(3)
    torch.manual_seed(7)
    actual = gm(x)
    after_rewritten = torch.rand(3)  # the generator advanced exactly as far
    assert actual.dtype == expected.dtype and actual.stride() == expected.stride()
    assert torch.equal(actual, expected) and torch.equal(after_rewritten, after_eager)


def test_a_buffer_viewed_before_the_draw_is_left_alone() -> None:
    def f(x):
        buffer = torch.empty_like(x)
        flat = buffer.view(-1)  # aliases the float buffer: the draw must land in it
        buffer.bernoulli_(0.5)
        return x * flat.view_as(x)

    x = torch.randn(8)
    gm = make_fx(f)(x)
    assert draw_masks_as_bytes(gm) == 0
    torch.manual_seed(3)
    expected = f(x)
    torch.manual_seed(3)
    assert torch.equal(gm(x), expected)


class WideDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 2048)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(2048, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(self.up(x)))


@pytest.mark.inductor
def test_inductor_step_keeps_the_mask_in_one_byte_per_element() -> None:
    # Between forward and backward the step needs the dropout's output (4 bytes per element,
    # read by the last Linear's weight gradient) and its mask. Measured: 5.02 MiB with the
    # mask in bytes, 8.02 MiB with the float mask (eager PyTorch: 12.0 MiB).
    torch.manual_seed(0)
    model = WideDropout()
    x, y = torch.randn(512, 32), torch.randn(512, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = functacc.compile_step(model, nn.MSELoss(), opt, backend="inductor")
    step(x, y)
    elements = 512 * 2048
    needed = 4 * elements + 1 * elements
    assert peak_memory(lambda: step(x, y)) <= needed + 64 * 1024


@pytest.mark.inductor
@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_step_draws_eagers_masks_and_leaves_the_generator_where_eager_does(
    dynamic: bool,
) -> None:
    # Masks of up to a million elements (functacc's kernel where it builds; with symbolic
    # batch sizes too): the losses match eager's only if every mask does, and the generator
    # must end where eager's does.
    torch.manual_seed(0)
    model = WideDropout()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    step = functacc.compile_step(model, nn.MSELoss(), opt, backend="inductor", dynamic=dynamic)
    batches = [512, 384, 200] if dynamic else [512, 512, 512]
    for i, n in enumerate(batches):
        x, y = torch.randn(n, 32), torch.randn(n, 1)
        torch.manual_seed(10 + i)
        loss = step(x, y)
        state = torch.get_rng_state()
        torch.manual_seed(10 + i)
        ref_opt.zero_grad()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(state, torch.get_rng_state()), f"step {i}: generator state"
        # Inductor's tolerance (its fused kernels sum in another order than eager's).
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.state_dict(), ref.state_dict(), rtol=1e-4, atol=1e-5)
