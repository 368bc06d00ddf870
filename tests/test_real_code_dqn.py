"""PyTorch's DQN tutorial (pytorch/tutorials, intermediate_source/reinforcement_q_learning.py,
its 2023 form: AdamW with amsgrad, ``SmoothL1Loss``, ``clip_grad_value_``) through
``functacc.jit``: where the step cannot be eager's, the error or the warning says which line
and what to write instead, and that advice, followed, trains as eager does.

``optimize_model()`` reads the script's replay memory: ``if len(memory) < BATCH_SIZE:
return``, then ``transitions = memory.sample(BATCH_SIZE)`` (``random.sample`` of a deque), a
batch whose ``next_state`` is ``None`` for a final state. As written, jitted, it is one
trace per memory length while the memory fills, then a ``TraceError`` at the sample (a draw
from a population cannot be fed). Before 2026-11-29 that error named neither the line nor
the statement to move, and with the sample moved out of the step each batch's pattern of
``None`` was a trace, told as "61 tensors -> 63 ... [14]: (1,) float32 -> (1, 4) float32",
the ``RetraceError`` at the 33rd printing every input of the last 5 traces (about 20,000
characters) and advising ``compile_step(..., max_traces=None)``. Now the warning names
``transitions[3].next_state: None -> a tensor`` and advises a mask; the masked step is one
trace, eager's numbers bit for bit (``backend="eager"``).
"""

from __future__ import annotations

import logging
import random
from collections import deque, namedtuple

import pytest
import torch
from torch import nn, optim

import functacc
from functacc.errors import RetraceError, TraceError

# -- the tutorial's code, as written (smaller network and batch) -----------------------------
Transition = namedtuple("Transition", ("state", "action", "next_state", "reward"))


class ReplayMemory:
    def __init__(self, capacity):
        self.memory = deque(maxlen=capacity)

    def push(self, *args):
        """Save a transition"""
        self.memory.append(Transition(*args))

    def sample(self, batch_size):
        return random.sample(self.memory, batch_size)

    def __len__(self):
        return len(self.memory)


class DQN(nn.Module):
    def __init__(self, n_observations, n_actions):
        super().__init__()
        self.layer1 = nn.Linear(n_observations, 16)
        self.layer2 = nn.Linear(16, 16)
        self.layer3 = nn.Linear(16, n_actions)

    def forward(self, x):
        x = torch.relu(self.layer1(x))
        x = torch.relu(self.layer2(x))
        return self.layer3(x)


BATCH_SIZE, GAMMA, LR = 8, 0.99, 1e-3


def agent() -> tuple[DQN, DQN, optim.Optimizer, ReplayMemory]:
    torch.manual_seed(0)
    random.seed(0)
    policy_net, target_net = DQN(4, 2), DQN(4, 2)
    target_net.load_state_dict(policy_net.state_dict())
    optimizer = optim.AdamW(policy_net.parameters(), lr=LR, amsgrad=True)
    return policy_net, target_net, optimizer, ReplayMemory(1000)


def tutorial_step(policy_net, target_net, optimizer, memory, *, sampled_inside: bool = True):
    """The tutorial's ``optimize_model``; ``sampled_inside=False``: the sample moved out, as
    the error advises (the batch its argument)."""

    def optimize_model(transitions):
        batch = Transition(*zip(*transitions, strict=True))
        non_final_mask = torch.tensor(
            tuple(map(lambda s: s is not None, batch.next_state)), dtype=torch.bool
        )
        non_final_next_states = torch.cat([s for s in batch.next_state if s is not None])
        state_batch = torch.cat(batch.state)
        action_batch = torch.cat(batch.action)
        reward_batch = torch.cat(batch.reward)
        state_action_values = policy_net(state_batch).gather(1, action_batch)
        next_state_values = torch.zeros(BATCH_SIZE)
        with torch.no_grad():
            next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values
        expected_state_action_values = (next_state_values * GAMMA) + reward_batch
        criterion = nn.SmoothL1Loss()
        loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
        optimizer.step()

    if not sampled_inside:
        return optimize_model

    def optimize_model_as_written():
        if len(memory) < BATCH_SIZE:
            return
        transitions = memory.sample(BATCH_SIZE)
        optimize_model(transitions)

    return optimize_model_as_written


def push_transitions(memory: ReplayMemory, n: int, g: torch.Generator) -> None:
    """``n`` transitions as the loop pushes them; every third state final (``None``)."""
    for t in range(n):
        state = torch.randn(1, 4, generator=g)
        action = torch.randint(0, 2, (1, 1), generator=g)
        next_state = None if t % 3 == 2 else torch.randn(1, 4, generator=g)
        memory.push(state, action, next_state, torch.ones(1))


def snapshot(policy_net, optimizer) -> tuple:
    return (
        {k: v.clone() for k, v in policy_net.state_dict().items()},
        repr(optimizer.state_dict()["state"]),
        random.getstate(),
    )


def test_the_step_as_written_names_the_sample_and_the_statement_to_move_out(caplog) -> None:
    policy_net, target_net, optimizer, memory = agent()
    step = functacc.jit(
        tutorial_step(policy_net, target_net, optimizer, memory),
        modules=[policy_net, target_net],
        optimizers=[optimizer],
        backend="eager",
    )
    g = torch.Generator().manual_seed(1)
    # While the memory fills, each length is a trace; the warning says to check outside.
    with caplog.at_level(logging.WARNING, logger="functacc"):
        for _ in range(3):
            push_transitions(memory, 1, g)
            step()
    said = caplog.text
    assert step.num_traces == 3 and "memory.__len__(): 2 -> 3" in said, said
    assert "check the length before the call" in said, said
    push_transitions(memory, BATCH_SIZE, g)
    before = snapshot(policy_net, optimizer)
    with pytest.raises(TraceError) as raised:
        step()
    message = str(raised.value)
    assert "random.sample, at test_real_code_dqn.py:" in message, message
    assert "in sample: `return random.sample(self.memory, batch_size)`" in message
    assert "run `transitions = memory.sample(BATCH_SIZE)` before the call" in message
    after = snapshot(policy_net, optimizer)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert after[1:] == before[1:]  # no optimizer state, Python's generator where it was


def train(steps: int, jit: bool = True):
    policy_net, target_net, optimizer, memory = agent()
    step = tutorial_step(policy_net, target_net, optimizer, memory, sampled_inside=False)
    if jit:
        step = functacc.jit(
            step,
            modules=[policy_net, target_net],
            optimizers=[optimizer],
            backend="eager",
        )
    g = torch.Generator().manual_seed(1)
    push_transitions(memory, BATCH_SIZE, g)
    for _ in range(steps):
        push_transitions(memory, 1, g)
        step(memory.sample(BATCH_SIZE))
    return policy_net, optimizer, step


def test_the_sample_moved_out_trains_as_eager_and_the_retrace_names_the_none(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="functacc"):
        policy_net, optimizer, step = train(steps=4)
    reference, reference_opt, _ = train(steps=4, jit=False)
    for (name, a), b in zip(
        policy_net.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert repr(optimizer.state_dict()) == repr(reference_opt.state_dict())
    said = caplog.text
    assert step.num_traces > 1  # a trace per pattern of None: what the warning explains
    assert ".next_state: None -> a tensor" in said or ".next_state: a tensor -> None" in said
    assert "torch.where(done, 0.0, target_net(next_states).max(1).values)" in said


def test_the_retrace_error_is_short_and_changes_nothing() -> None:
    policy_net, target_net, optimizer, memory = agent()
    step = functacc.jit(
        tutorial_step(policy_net, target_net, optimizer, memory, sampled_inside=False),
        modules=[policy_net, target_net],
        optimizers=[optimizer],
        backend="eager",
        max_traces=1,
    )
    g = torch.Generator().manual_seed(1)
    push_transitions(memory, BATCH_SIZE, g)
    batch = list(memory.memory)
    step(batch)
    flipped = [
        b._replace(next_state=torch.zeros(1, 4)) if b.next_state is None else b for b in batch
    ]
    before = snapshot(policy_net, optimizer)
    with pytest.raises(RetraceError) as raised:
        step(flipped)
    message = str(raised.value)
    assert "[2].next_state: None -> a tensor" in message, message
    assert "max_traces=None (of jit or compile_step) means no limit" in message
    assert len(message) < 2000 and "(32 in all)" in message, len(message)
    after = snapshot(policy_net, optimizer)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert after[1] == before[1]


def test_the_masked_step_the_advice_gives_is_one_trace_and_eagers_numbers() -> None:
    # The advice followed: the batch as tensors, zeros for a final state's next state and a
    # mask of the final ones; the same code run eagerly is the reference.
    def run(jit: bool) -> tuple:
        policy_net, target_net, optimizer, memory = agent()

        def optimize_model(state_batch, action_batch, next_states, done, reward_batch):
            state_action_values = policy_net(state_batch).gather(1, action_batch)
            with torch.no_grad():
                next_values = torch.where(done, 0.0, target_net(next_states).max(1).values)
            expected_state_action_values = (next_values * GAMMA) + reward_batch
            loss = nn.SmoothL1Loss()(state_action_values, expected_state_action_values.unsqueeze(1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
            optimizer.step()
            return loss.item()

        step = optimize_model
        if jit:
            step = functacc.jit(
                step, modules=[policy_net, target_net], optimizers=[optimizer], backend="eager"
            )
        g = torch.Generator().manual_seed(1)
        push_transitions(memory, BATCH_SIZE, g)
        losses = []
        for _ in range(6):
            push_transitions(memory, 1, g)
            batch = Transition(*zip(*memory.sample(BATCH_SIZE), strict=True))
            done = torch.tensor([s is None for s in batch.next_state])
            next_states = torch.cat(
                [torch.zeros(1, 4) if s is None else s for s in batch.next_state]
            )
            losses.append(
                step(
                    torch.cat(batch.state),
                    torch.cat(batch.action),
                    next_states,
                    done,
                    torch.cat(batch.reward),
                )
            )
        traces = step.num_traces if jit else 0
        return losses, policy_net.state_dict(), repr(optimizer.state_dict()), traces

    jitted, eager = run(True), run(False)
    assert jitted[3] == 1
    assert jitted[0] == eager[0] and isinstance(jitted[0][0], float)
    assert all(
        torch.equal(a, b) for a, b in zip(jitted[1].values(), eager[1].values(), strict=True)
    )
    assert jitted[2] == eager[2]
