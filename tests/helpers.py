"""The reference: the same training written as a plain eager PyTorch loop."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

Batch = tuple[Any, Any]


def seed_for(i: int) -> int:
    # Both loops reseed before step i, so dropout draws the same masks if (and only if) the
    # compiled step consumes the RNG exactly as eager PyTorch does.
    return 1000 + i


def seeded_linear(n_in: int = 3) -> tuple[nn.Linear, torch.optim.SGD]:
    """``nn.Linear(n_in, 1)`` seeded with 0 and its ``SGD(lr=0.1)``: the model of the tests
    of a step's Python state, where the state is what differs."""
    torch.manual_seed(0)
    model = nn.Linear(n_in, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def minimize(opt: torch.optim.Optimizer, loss: Tensor) -> Tensor:
    """One eager update on ``loss`` (zero_grad, backward, step); ``loss`` returned."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def model_loss(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, dict):
        return out["loss"]
    return out.loss


def eager_train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: Callable | None,
    batches: Sequence[Batch],
    *,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    scheduler: Any = None,
) -> list[Tensor]:
    """Train eagerly; with accumulation, (loss_i / k).backward() per micro-batch."""
    losses = []
    for i, (inputs, targets) in enumerate(batches):
        torch.manual_seed(seed_for(i))
        opt.zero_grad(set_to_none=True)
        k = grad_accum_steps
        micro_losses = []
        for j in range(k):
            micro_in = _chunk(inputs, k, j)
            micro_t = _chunk(targets, k, j)
            if loss_fn is None:
                loss = model_loss(call_model(model, micro_in))
            else:
                loss = loss_fn(call_model(model, micro_in), micro_t)
            (loss / k if k > 1 else loss).backward()
            micro_losses.append(loss.detach())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(micro_losses[0] if k == 1 else torch.stack(micro_losses).mean())
    return losses


def functacc_train(step: Any, batches: Sequence[Batch], *, scheduler: Any = None) -> list[Tensor]:
    losses = []
    for i, (inputs, targets) in enumerate(batches):
        torch.manual_seed(seed_for(i))
        if step.loss_fn is None:
            if isinstance(inputs, dict):
                losses.append(step(**inputs))
            else:
                losses.append(step(*inputs) if isinstance(inputs, tuple) else step(inputs))
        else:
            losses.append(step(inputs, targets))
        if scheduler is not None:
            scheduler.step()
    return losses


def _chunk(x: Any, k: int, j: int) -> Any:
    if k == 1:
        return x
    if isinstance(x, Tensor):
        return x.tensor_split(k)[j]
    if isinstance(x, dict):
        return {n: _chunk(v, k, j) for n, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_chunk(v, k, j) for v in x)
    return x


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float, what: str) -> None:
    """Exact comparison when rtol == atol == 0 (NaNs compare equal), else allclose."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), (
            f"{what}: keys {actual.keys()} != {expected.keys()}"
        )
        for k in expected:
            assert_close(actual[k], expected[k], rtol=rtol, atol=atol, what=f"{what}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, rtol=rtol, atol=atol, what=f"{what}[{i}]")
        return
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{what}: {type(actual)} is not a tensor"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}"
        )
        return
    assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def assert_same_training(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref_model: nn.Module,
    ref_opt: torch.optim.Optimizer,
    losses: list[Tensor],
    ref_losses: list[Tensor],
    *,
    rtol: float,
    atol: float,
    host_steps: bool = False,
) -> None:
    """``host_steps``: compare Adam's step counts on the host (where torch.optim keeps them
    for a non-capturable optimizer; a CUDA step keeps them on the GPU)."""
    assert_close(losses, ref_losses, rtol=rtol, atol=atol, what="losses")
    assert_close(model.state_dict(), ref_model.state_dict(), rtol=rtol, atol=atol, what="model")
    state = opt.state_dict()
    if host_steps:
        state["state"] = {
            k: {n: v.cpu() if n == "step" else v for n, v in s.items()}
            for k, s in state["state"].items()
        }
    assert_close(state, ref_opt.state_dict(), rtol=rtol, atol=atol, what="opt")


def twin(model: nn.Module, make_opt: Callable) -> tuple[nn.Module, Any, nn.Module, Any]:
    ref = copy.deepcopy(model)
    return model, make_opt(model), ref, make_opt(ref)


class Snapshot:
    """Everything a failed call must leave as it was: model, optimizer, step count, RNG."""

    def __init__(self, model: nn.Module, opt: Any, step: Any):
        self.model, self.opt, self.step = model, opt, step
        self.model_state = copy.deepcopy(model.state_dict())
        self.opt_state = copy.deepcopy(opt.state_dict())
        self.count = step.count
        self.rng = torch.get_rng_state()

    def assert_unchanged(self) -> None:
        assert_close(self.model.state_dict(), self.model_state, rtol=0, atol=0, what="model")
        assert_close(self.opt.state_dict(), self.opt_state, rtol=0, atol=0, what="optimizer")
        assert self.step.count == self.count
        assert torch.equal(torch.get_rng_state(), self.rng)


def assert_adamw_step_matches_eager(
    model: nn.Module, *, rtol: float, atol: float, inductor_options: dict | None = None
) -> None:
    """Three steps of ``functacc.compile_step`` (Inductor, AdamW lr=1e-2, cross-entropy on
    random 8 x 16 batches) against the same eager loop on a copy: losses and final weights."""
    import functacc

    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = functacc.compile_step(
        model, nn.CrossEntropyLoss(), opt, inductor_options=inductor_options
    )
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
        loss = step(x, y)
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol, what="loss")
    assert_close(model.state_dict(), ref.state_dict(), rtol=rtol, atol=atol, what="model")


def needs_inductor_random_order() -> None:
    """Skip on a torch whose Inductor may call two random draws of a graph in another order
    than the graph's (functacc._compat.INDUCTOR_KEEPS_RANDOM_ORDER: torch 2.11)."""
    from functacc._compat import INDUCTOR_KEEPS_RANDOM_ORDER

    if not INDUCTOR_KEEPS_RANDOM_ORDER:
        pytest.skip(
            "needs Inductor to call a graph's random draws in the graph's order, as torch "
            f"after 2.11 does (2.14.1 and 2.15.0 tested); torch {torch.__version__} may swap "
            "two dropouts' draws"
        )


@contextlib.contextmanager
def exact_cuda() -> Iterator[None]:
    """GPU comparisons that mean the step, not the libraries' choices: TF32 off (it rounds
    float32 matmul and convolution inputs to 10 bits) and cuDNN's deterministic algorithms
    only (some convolution backward algorithms add with atomics, in whatever order the
    blocks finish: an H200 run gave a captured and an uncaptured EMA+SAM step losses one
    ulp apart)."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = matmul.allow_tf32, cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved


def run_torchrun_worker(worker: str, out: Any, nproc: int = 2) -> Any:
    """Run ``tests/dist/<worker>.py OUT`` under torchrun (one node, ``nproc`` gloo ranks,
    one thread each) and load what its rank 0 saved in ``out``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(here.parent), str(here / "dist")]),
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.run(
        [*cmd, f"--nproc_per_node={nproc}", str(here / "dist" / f"{worker}.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out, weights_only=False)
