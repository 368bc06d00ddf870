"""functacc.optim against torch.optim and torch.nn.utils, run eagerly (no tracing).

The functional optimizers use the same ATen kernels in the same order as torch.optim's
single-tensor implementations, so the comparison is exact (bit for bit).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import functacc
from functacc import optim

STEPS = 10

# (torch constructor, functacc constructor) pairs with the same hyperparameters.
TABLE = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), lambda: optim.sgd(0.1)),
    "sgd_momentum": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda: optim.sgd(0.1, momentum=0.9),
    ),
    "sgd_nesterov_wd": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "sgd_dampening_maximize": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.5, maximize=True),
        lambda: optim.sgd(0.05, momentum=0.5, dampening=0.5, maximize=True),
    ),
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2), lambda: optim.adam(1e-2)),
    "adam_l2_amsgrad": (
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.9)),
        lambda: optim.adam(1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.9)),
    ),
    "adamw": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda: optim.adamw(1e-2, weight_decay=0.1),
    ),
    "adamw_maximize_eps": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-3, maximize=True),
        lambda: optim.adamw(1e-2, eps=1e-3, maximize=True),
    ),
}


def make_params(dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(33, 17, generator=g, dtype=dtype),  # odd sizes: vector loop + tail
        "b": torch.randn(17, generator=g, dtype=dtype),
        "big": torch.randn(4099, generator=g, dtype=dtype),
    }


def grads_at(i: int, params: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(TABLE))
def test_named_optimizer_matches_torch(name: str, dtype: torch.dtype) -> None:
    make_torch, make_ours = TABLE[name]
    params = make_params(dtype)
    torch_params = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    torch_opt = make_torch(list(torch_params.values()))
    ours = make_ours()
    state = ours.init(params)
    for i in range(STEPS):
        grads = grads_at(i, params)
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        updates, state = ours.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    for n, p in torch_params.items():
        # update() + apply_updates rounds p + (new - p): equal to torch up to the last bit.
        torch.testing.assert_close(params[n], p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(TABLE))
def test_low_precision_parameters_match_torch_bit_for_bit(name: str, dtype) -> None:
    # torch's bf16/fp16 kernels compute in float32 with each scalar as the kernel takes it
    # (beta2 = 0.999 stays 0.999, not bf16's 0.99951) and round once per kernel. Sizes are
    # multiples of the CPU vector width: eager's own scalar path for a tensor's last few
    # elements rounds add(alpha=) differently (bf16 arithmetic), which no graph can follow.
    make_torch, make_ours = TABLE[name]
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 32, generator=g), "big": torch.randn(4096, generator=g)}
    params = {n: p.to(dtype) for n, p in params.items()}
    torch_params = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    torch_opt = make_torch(list(torch_params.values()))
    ours = make_ours()
    state = ours.init(params)
    for i in range(STEPS):
        grads = {n: (x * 0.1).to(dtype) for n, x in grads_at(i, params).items()}
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        params, state = optim._transform.step_params(ours, grads, state, params)
    for n, p in torch_params.items():
        # NaN where torch has NaN too (fp16 Adam: eps 1e-8 rounds to 0 in float16).
        torch.testing.assert_close(params[n], p.detach(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adam_square_root_rounds_as_torch_at_every_value(dtype) -> None:
    # AMSGrad's running maximum set to every positive normal number of the dtype: Adam's
    # denominator takes the square root of each. torch's 16-bit CPU sqrt does not always
    # round as float32's sqrt rounded to the dtype (fp16: 15 of 30,720 values, e.g.
    # 0.01561737 -> 0.12494 vs 0.125; seen first as a 1-ulp parameter difference on torch
    # 2.11, whose fp16 randn gave the optimizer test other gradients).
    bits = (0x0400, 0x7C00) if dtype == torch.float16 else (0x0080, 0x7F80)
    values = torch.arange(*bits, dtype=torch.int16).view(dtype)
    p = nn.Parameter(torch.zeros_like(values))  # the update alone: no rounding into p
    p.grad = torch.full_like(values, 1e-2)
    torch_opt = torch.optim.Adam([p], lr=1e-2, amsgrad=True)
    zeros = torch.zeros_like(values)
    torch_opt.state[p] = {
        "step": torch.tensor(0.0),
        "exp_avg": zeros.clone(),
        "exp_avg_sq": zeros.clone(),
        "max_exp_avg_sq": values.clone(),
    }
    ours = optim.adam(1e-2, amsgrad=True)
    state = ours.init({"p": p.detach().clone()})
    state = state._replace(max_exp_avg_sq={"p": values.clone()})
    new, _ = optim._transform.step_params(
        ours, {"p": p.grad.clone()}, state, {"p": p.detach().clone()}
    )
    torch_opt.step()
    assert torch.equal(new["p"], p.detach())


@pytest.mark.parametrize("name", list(TABLE))
def test_update_params_is_bit_exact(name: str) -> None:
    make_torch, make_ours = TABLE[name]
    params = make_params()
    torch_params = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    torch_opt = make_torch(list(torch_params.values()))
    ours = make_ours()
    state = ours.init(params)
    for i in range(STEPS):
        grads = grads_at(i, params)
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        params, state = optim._transform.step_params(ours, grads, state, params)
    for n, p in torch_params.items():
        assert torch.equal(params[n], p.detach()), n


def test_parameters_without_gradient_are_skipped() -> None:
    params = make_params()
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    grads = grads_at(0, params)
    del grads["b"]
    updates, new_state = opt.update(grads, state, params)
    assert "b" not in updates
    assert new_state.exp_avg["b"] is state.exp_avg["b"]
    assert int(new_state.step["b"]) == 0 and int(new_state.step["w"]) == 1


def test_clip_by_global_norm_matches_clip_grad_norm() -> None:
    params = make_params()
    for max_norm in (0.5, 1e6):  # clipping engaged, and not
        grads = grads_at(3, params)
        torch_params = [nn.Parameter(p.clone()) for p in params.values()]
        for p, g in zip(torch_params, grads.values(), strict=True):
            p.grad = g.clone()
        total = torch.nn.utils.clip_grad_norm_(torch_params, max_norm)
        clipped, _ = optim.clip_by_global_norm(max_norm).update(grads, (), params)
        assert torch.equal(optim.global_norm(grads), total)
        for p, g in zip(torch_params, clipped.values(), strict=True):
            assert torch.equal(p.grad, g)


def test_chain_applies_in_order() -> None:
    params = make_params()
    grads = grads_at(0, params)
    chained = optim.chain(optim.clip_by_global_norm(0.1), optim.sgd(1.0))
    updates, _ = chained.update(grads, chained.init(params), params)
    clipped, _ = optim.clip_by_global_norm(0.1).update(grads, (), params)
    for n in params:
        torch.testing.assert_close(updates[n], -clipped[n], rtol=1e-5, atol=1e-6)
    assert chained.update_params is not None  # ends in a named optimizer: exact path kept


def test_schedules_values() -> None:
    c = torch.arange(0, 12)
    assert torch.equal(optim.constant(0.3)(c), torch.full((12,), 0.3, dtype=torch.float64))
    warm = optim.linear_warmup(1.0, 4, init_value=0.2)
    expected = [0.2 + 0.8 * min(i / 4, 1.0) for i in range(12)]
    assert [round(float(v), 12) for v in warm(c)] == [round(v, 12) for v in expected]
    cos = optim.cosine_decay(2.0, 10, alpha=0.1)
    for i in range(12):
        frac = min(i / 10, 1.0)
        want = 2.0 * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * frac)) + 0.1)
        assert abs(float(cos(torch.tensor(i))) - want) < 1e-12
    joined = optim.linear_warmup(1.0, 2, after=optim.cosine_decay(1.0, 4))
    assert [round(float(joined(torch.tensor(i))), 6) for i in (0, 1, 2, 4, 6, 9)] == [
        0.0,
        0.5,
        1.0,
        0.5,
        0.0,
        0.0,
    ]


def test_schedule_matches_lambda_lr_inside_compiled_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    ref = nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    schedule = optim.cosine_decay(0.1, 5)
    step = functacc.compile_step(model, nn.MSELoss(), optim.sgd(schedule), backend="eager")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        ref_opt, lambda i: float(schedule(torch.tensor(i))) / 0.1
    )
    for i in range(8):
        x, y = torch.randn(4, 6), torch.randn(4, 3)
        step(x, y)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        sched.step()
        torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-7, msg=f"step {i}")
    assert step.num_traces == 1


def test_from_torch_continues_a_half_trained_optimizer() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()
    named = dict(model.named_parameters())
    ours = optim.from_torch(opt, named_parameters=named)
    state = ours.init(named)
    assert int(state[0].step["weight"]) == 3
    assert torch.equal(state[0].exp_avg["weight"], opt.state[model.weight]["exp_avg"])
    assert state[0].exp_avg["weight"] is not opt.state[model.weight]["exp_avg"]  # a copy


def test_invalid_hyperparameters_raise() -> None:
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        optim.adam(betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="lr must be a float or a schedule"):
        optim.sgd("0.1")
    with pytest.raises(ValueError, match="warmup_steps"):
        optim.linear_warmup(1.0, 0)
