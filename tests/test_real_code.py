"""Training code as public examples write it, through ``functacc.jit``, against eager.

The patterns here failed before (47f8e2f) with errors whose advice could not work: a
Transformer encoder given a causal mask (torch compares the mask's values with a causal
one), and an actor-critic update whose loss was built before the step (the advice was to
pass the tensor as an argument, which cannot help). ``return loss.item()`` and the
recurrent layers have their own tests (tests/test_jit_python.py, tests/test_recurrent.py).
With ``backend="eager"`` losses and parameters are compared bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functacc


def encoder(seed: int = 0) -> tuple[nn.ModuleDict, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    model = nn.ModuleDict(
        {
            "enc": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            "head": nn.Linear(16, 5),
        }
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def lm_step(model: nn.ModuleDict, opt: torch.optim.Optimizer):
    # pytorch/examples word_language_model's TransformerModel: the mask is an argument.
    def body(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        logits = model["head"](model["enc"](x, mask=mask))
        loss = F.cross_entropy(logits.reshape(-1, 5), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    return body


def test_a_causal_mask_passed_each_step_gives_eagers_numbers() -> None:
    model, opt = encoder()
    ref, ref_opt = copy.deepcopy(model), copy.deepcopy(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    step = functacc.jit(lm_step(model, opt), modules=[model], optimizers=[opt], backend="eager")
    eager = lm_step(ref, ref_opt)
    causal = nn.Transformer.generate_square_subsequent_mask(8)
    padding = torch.zeros(8, 8)
    padding[:, 6:] = float("-inf")  # not causal: torch takes the other branch
    g = torch.Generator().manual_seed(1)
    for i, mask in enumerate([causal, causal, causal.clone(), padding, causal]):
        x, y = torch.randn(4, 8, 16, generator=g), torch.randint(0, 5, (4, 8), generator=g)
        torch.manual_seed(i)
        got = step(x, y, mask)
        torch.manual_seed(i)
        assert torch.equal(got, eager(x, y, mask)), i
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    # One graph per distinct mask value: a clone of the causal mask is the same value.
    assert step.num_traces == 2, [t.reason for t in step.traces]
    assert "batch values" in step.traces[1].reason


def test_a_causal_mask_made_inside_the_step_says_is_causal() -> None:
    model, _ = encoder()

    def body(x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return model["enc"](x, mask=mask).sum()

    with pytest.raises(functacc.TraceError, match="is_causal=True"):
        functacc.jit(body, modules=[model], backend="eager")(torch.randn(2, 8, 16))

    def hinted(x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return model["enc"](x, mask=mask, is_causal=True).sum()

    x = torch.randn(2, 8, 16)
    torch.manual_seed(0)
    got = functacc.jit(hinted, modules=[model], backend="eager")(x)
    torch.manual_seed(0)
    assert torch.equal(got, hinted(x).detach())


def test_a_loss_built_before_the_step_gets_advice_that_can_work() -> None:
    # pytorch/examples reinforcement_learning/actor_critic.py: the episode's log-probs are
    # computed while acting, then finish_episode() calls loss.backward() on them.
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    saved_log_probs: list[torch.Tensor] = []
    for _ in range(5):
        probs = torch.softmax(policy(torch.randn(4)), -1)
        saved_log_probs.append(torch.log(probs[torch.multinomial(probs, 1)]))

    def finish_episode(returns: torch.Tensor) -> torch.Tensor:
        loss = (-torch.cat(saved_log_probs) * returns).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    before = [p.clone() for p in policy.parameters()]
    step = functacc.jit(finish_episode, modules=[policy], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError) as raised:
        step(torch.randn(5))
    message = str(raised.value)
    assert "autograd history" in message and "saved_log_probs" in message
    assert (
        "compute it inside the step" in message and "pass the tensor as an argument" not in message
    )
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))

    # What the advice says, done: keep the observations, recompute the log-probs inside.
    def update(states: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(policy(states), -1).gather(1, actions[:, None])[:, 0]
        loss = (-log_probs * returns).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    states, actions = torch.randn(5, 4), torch.randint(0, 2, (5,))
    returns = torch.randn(5)
    reference = copy.deepcopy(policy)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    got = functacc.jit(update, modules=[policy], optimizers=[opt], backend="eager")(
        states, actions, returns
    )
    log_probs = torch.log_softmax(reference(states), -1).gather(1, actions[:, None])[:, 0]
    expected = (-log_probs * returns).sum()
    ref_opt.zero_grad()
    expected.backward()
    ref_opt.step()
    assert torch.equal(got, expected.detach())
    assert all(
        torch.equal(a, b) for a, b in zip(policy.parameters(), reference.parameters(), strict=True)
    )


def test_a_branch_on_a_value_names_the_line_and_what_is_fine() -> None:
    model = nn.Linear(4, 1)

    def branchy(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        return loss if loss.item() > 0 else -loss

    with pytest.raises(functacc.TraceError, match=r"returning or storing\s+loss.item\(\) is fine"):
        functacc.jit(branchy, modules=[model], backend="eager")(torch.randn(2, 4))


def test_a_grad_scaler_passed_in_is_a_clear_error_that_leaves_it_as_it_was() -> None:
    # The AMP recipe's loop with the scaler as an argument of the step: functacc.jit moves
    # GradScaler.step's skip into the graph only for a scaler the body holds
    # (test_jit_amp.py). The failed trace must not leave its fake tensors in the scaler (its
    # scale is made at the first scale(), its per-optimizer state filled in place), so the
    # same loop still runs eagerly afterwards with eager's numbers.
    def build() -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

        def body(x: torch.Tensor, y: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        return model, opt, scaler, body

    model, opt, scaler, body = build()
    ref_model, ref_opt, ref_scaler, ref_body = build()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step = functacc.jit(body, modules=[model], optimizers=[opt], backend="eager")
    with pytest.raises(functacc.TraceError, match=r"(?s)GradScaler.step\(\).*refer to it by name"):
        step(x, y, scaler)
    assert scaler._scale is None and not scaler._per_optimizer_states
    assert opt.state_dict() == ref_opt.state_dict()
    for _ in range(2):  # eagerly, as if jit had never been tried
        assert torch.equal(body(x, y, scaler), ref_body(x, y, ref_scaler))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scaler.get_scale() == ref_scaler.get_scale()
