"""Activation rematerialisation: the same step, bit for bit, with less memory."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from torch import nn

import functacc
from functacc.memory import peak_memory


class Block(nn.Module):
    """A residual MLP block with 4x-wide activations and dropout."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(nn.functional.gelu(self.up(x))))


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(128) for _ in range(8)], nn.Linear(128, 10))


def run(remat, steps: int = 3, backend: str = "eager"):
    model = deep_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = functacc.compile_step(model, nn.CrossEntropyLoss(), opt, backend=backend, remat=remat)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 128, generator=g), torch.randint(0, 10, (512,), generator=g)
    losses = []
    for i in range(steps):
        torch.manual_seed(i)
        losses.append(step(x, y))
    torch.manual_seed(steps)
    peak = peak_memory(lambda: step(x, y))
    return model, losses, peak


def test_remat_same_result_and_less_memory() -> None:
    model, losses, peak = run(None)
    remat_model, remat_losses, remat_peak = run({"Block"})
    # Recomputation replays dropout's draws, so the step is identical, bit for bit.
    assert_close(remat_losses, losses, rtol=0, atol=0, what="losses")
    assert_close(remat_model.state_dict(), model.state_dict(), rtol=0, atol=0, what="params")
    assert remat_peak <= 0.7 * peak, f"{remat_peak / 2**20:.1f} MiB vs {peak / 2**20:.1f} MiB"


def test_recomputation_reads_the_step_parameters_not_the_module() -> None:
    # Backward runs after functional_call has swapped the module's own parameters back in;
    # a recomputation that read them computed gradients at the module's weights, not at
    # the state given to the step (and Inductor baked those weights in at the first step).
    torch.manual_seed(0)
    model = nn.Sequential(Block(16), nn.Linear(16, 4))
    model[0].drop.p = 0.0
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    losses_and_grads = []
    for remat in (None, {"Block"}):
        step = functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=1.0),
            backend="eager",
            remat=remat,
        )
        state = step.init_state()
        state.params.update({n: p * 2 for n, p in state.params.items()})  # not the module's
        new, loss = step.apply(state, x, y)
        losses_and_grads.append((loss, {n: state.params[n] - new.params[n] for n in new.params}))
    assert_close(losses_and_grads[1], losses_and_grads[0], rtol=0, atol=0, what="remat")


@pytest.mark.inductor
def test_remat_under_inductor_matches_and_lowers_memory() -> None:
    model, losses, peak = run(None, backend="inductor")
    remat_model, remat_losses, remat_peak = run({"Block"}, backend="inductor")
    # The same arithmetic in other kernels: float32 rounding, over 3 AdamW steps.
    assert_close(remat_losses, losses, rtol=1e-5, atol=1e-6, what="losses")
    assert_close(remat_model.state_dict(), model.state_dict(), rtol=1e-4, atol=1e-6, what="params")
    assert remat_peak <= 0.7 * peak, f"{remat_peak / 2**20:.1f} MiB vs {peak / 2**20:.1f} MiB"


def test_remat_unknown_class() -> None:
    model = deep_mlp()
    with pytest.raises(ValueError, match=r"remat names \['Bottleneck'\].*Block, Dropout"):
        functacc.compile_step(
            model,
            nn.CrossEntropyLoss(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            remat={"Bottleneck"},
        )
